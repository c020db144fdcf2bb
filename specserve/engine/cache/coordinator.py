"""One interface over the cache managers of a model's layer groups.

The scheduler and the engine speak to the coordinator about a sequence; the coordinator
forwards to each group's manager with that group's table (``seq.cache.tables[g]``). The first
group is the model's growing full-attention pool: its blocks are what admission and preemption
count, and what the prefix cache matches (a hit is used only if every group can take it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.block_manager import NoFreeBlocks
from specserve.engine.cache.managers import (FullAttentionManager, RecurrentStateManager, RecurrentTable,
                                             SlidingWindowManager)
from specserve.engine.cache.specs import CacheSpec, FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec

Manager = FullAttentionManager | SlidingWindowManager | RecurrentStateManager


@dataclass
class SequenceCache:
    """A sequence's handle into every group: one table per manager, in group order."""

    tables: list = field(default_factory=list)


def make_manager(spec: CacheSpec, size: int, prefix_caching: bool, salt: str) -> Manager:
    """size: blocks of a paged group, slots of a recurrent one."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, size)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, size, prefix_caching, salt)
    if isinstance(spec, RecurrentStateSpec):
        return RecurrentStateManager(spec, size)
    raise TypeError(f"no cache manager for {spec!r}")


class CacheCoordinator:
    def __init__(self, managers: list[Manager]):
        assert managers and isinstance(managers[0], FullAttentionManager), "group 0 is the growing pool"
        self.managers = managers

    @classmethod
    def build(cls, specs: tuple[CacheSpec, ...], sizes: tuple[int, ...], prefix_caching: bool,
              salt: str = "") -> "CacheCoordinator":
        """prefix_caching: asked for; it is on only when every group can serve a prefix hit
        (a sliding window's cached block would lack the window before it; a recurrent state needs
        checkpoints)."""
        prefix_caching = prefix_caching and all(
            type(s) is FullAttentionSpec or (isinstance(s, RecurrentStateSpec) and s.checkpoints) for s in specs)
        return cls([make_manager(s, n, prefix_caching, salt) for s, n in zip(specs, sizes, strict=True)])

    @property
    def main(self) -> FullAttentionManager:
        return self.managers[0]

    @property
    def prefix_caching(self) -> bool:
        return all(m.prefix_caching for m in self.managers)

    def groups(self, kind: type) -> list[int]:
        return [g for g, m in enumerate(self.managers) if isinstance(m, kind)]

    def _pairs(self, seq):
        if not seq.cache.tables:
            seq.cache.tables = [m.new_table() for m in self.managers]
        return zip(self.managers, seq.cache.tables)

    # ---- the verbs the engine uses -----------------------------------------------------------
    def match_prefix(self, seq) -> int:
        """Attach the longest cached prefix of seq's tokens; returns its token count (0 unless
        every group can serve prefix hits)."""
        if not self.prefix_caching:
            return 0
        main = next(iter(self._pairs(seq)))[1]
        n = self.main.match_prefix(main, seq.cache_keys)
        for g in self.groups(RecurrentStateManager):  # only as far as a state checkpoint reaches
            n_state = self.managers[g].match_prefix(seq.cache.tables[g], main.hashes[:n // self.main.spec.block_size])
            if n_state < n:
                self.main.pool.truncate(main, n_state)
                n = n_state
        return n

    def has_tables(self, seq) -> bool:
        return bool(seq.cache.tables) and bool(seq.cache.tables[0].blocks)

    def can_admit(self, seq, num_tokens: int) -> bool:
        """Whether the growing pool has the blocks to start seq at num_tokens tokens, plus one."""
        need = sum(m.blocks_to_admit(t, num_tokens) for m, t in self._pairs(seq) if m is self.main)
        return self.main.pool.can_allocate(need + 1)

    def reserve(self, seq, num_tokens: int) -> None:
        """Room for seq's first num_tokens tokens in every group; raises NoFreeBlocks (what was
        taken stays with the sequence, and is freed with it)."""
        for m, t in self._pairs(seq):
            m.reserve(t, num_tokens)

    def step_planes(self, seq, num_rows: int, every_row: bool) -> dict[int, list[int]]:
        """For each recurrent group: where this step's rows write their states."""
        return {g: self.managers[g].step_planes(seq.cache.tables[g], num_rows, every_row)
                for g in self.groups(RecurrentStateManager)}

    def commit(self, seq) -> None:
        for m, t in self._pairs(seq):
            m.commit(t, seq.cache_keys, seq.num_computed)
        for g in self.groups(RecurrentStateManager):  # checkpoints under the blocks just hashed
            self.managers[g].register(seq.cache.tables[g], seq.cache.tables[0].hashes)

    def rollback(self, seq) -> None:
        """After verification: keep the state of seq.num_computed tokens."""
        for m, t in self._pairs(seq):
            m.rollback(t, seq.num_computed)

    def advance(self, seq) -> None:
        """After any step: sliding windows release what they passed, states move on."""
        for m, t in self._pairs(seq):
            m.advance(t, seq.num_computed)

    def free(self, seq) -> None:
        for m, t in self._pairs(seq):
            m.free(t)

    # ---- for the model runner ----------------------------------------------------------------
    def state_entry(self, seq, row) -> tuple | None:
        """A scheduled row's recurrent state: (slot, plane read or -1 for the zero state, plane
        written after each of its rows or -1, checkpoint read or -1, checkpoint written after each
        row or -1). A verification writes after every row (any may be the last accepted); a prefill
        chunk after its last, and prefix-cache checkpoints at block boundaries. None: no recurrent
        group."""
        groups = self.groups(RecurrentStateManager)
        if not groups:
            return None
        assert len(groups) == 1, "one recurrent group: every linear-attention layer shares its slots"
        m, table = self.managers[groups[0]], seq.cache.tables[groups[0]]
        read = table.current if table.num_tokens and table.restore < 0 else -1
        planes = m.step_planes(table, row.count, every_row=row.decode)
        if row.decode:
            return table.slot, read, planes, table.restore, [-1] * row.count
        checkpoints = m.checkpoint_rows(table, row.count, len(seq.prompt_ids))
        return table.slot, read, [-1] * (row.count - 1) + planes, table.restore, checkpoints

    def block_tables(self, seq) -> list[list[int]]:
        """seq's block ids in each paged group (released sliding blocks are HOLE)."""
        return [t.blocks for m, t in self._pairs(seq) if not isinstance(t, RecurrentTable)]

    # ---- accounting ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.main.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.main.pool.num_free

    def idle(self) -> bool:
        """Nothing held by any sequence (cached-but-unreferenced blocks count as free)."""
        for m in self.managers:
            if isinstance(m, RecurrentStateManager):
                if m.num_free != m.num_slots:
                    return False
            elif m.pool.num_free != m.pool.num_blocks:
                return False
        return True


__all__ = ["CacheCoordinator", "NoFreeBlocks", "SequenceCache", "make_manager"]
