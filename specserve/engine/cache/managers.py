"""One manager per kind of layer state: allocate, hit the prefix cache, roll back, free.

Every manager keeps one *table* per sequence (its handle into the manager's storage) and has the
same verbs, so the coordinator treats them alike:

* ``reserve(table, num_tokens)``: make room for the sequence's first num_tokens tokens (the
  scheduler asks for the step's rows, drafts included); raises ``NoFreeBlocks``.
* ``match_prefix(table, token_ids)``: attach cached state of the longest cached prefix.
* ``commit(table, token_ids, num_computed)``: make computed state reusable by later requests.
* ``rollback(table, num_computed)``: keep the state of the first num_computed tokens (drafts
  that were rejected are dropped) — bookkeeping only.
* ``advance(table, num_computed)``: after a step; the sliding window releases what it passed.
* ``free(table)``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from specserve.engine.block_manager import BlockManager, BlockTable, NoFreeBlocks
from specserve.engine.cache.specs import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec


class FullAttentionManager:
    """Paged K/V with prefix caching (a thin layer over :class:`BlockManager`)."""

    def __init__(self, spec: FullAttentionSpec, num_blocks: int, prefix_caching: bool, salt: str = ""):
        self.spec = spec
        self.pool = BlockManager(num_blocks, spec.block_size, prefix_caching, salt=salt)

    @property
    def prefix_caching(self) -> bool:
        return self.pool.prefix_caching

    def new_table(self) -> BlockTable:
        return BlockTable()

    def match_prefix(self, table: BlockTable, token_ids: list[int]) -> int:
        return self.pool.match_prefix(table, token_ids)

    def blocks_to_admit(self, table: BlockTable, num_tokens: int) -> int:
        """New blocks a sequence needs before it can run with num_tokens tokens."""
        return max(self.pool.blocks_needed(num_tokens) - len(table.blocks), 0)

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        self.pool.ensure_capacity(table, num_tokens)

    def commit(self, table: BlockTable, token_ids: list[int], num_computed: int) -> None:
        self.pool.commit(table, token_ids, num_computed)

    def rollback(self, table: BlockTable, num_computed: int) -> None:
        """Drop the blocks past the computed tokens, keeping the slot of the next token (the one
        the next step writes first)."""
        self.pool.truncate(table, num_computed + 1)

    def advance(self, table: BlockTable, num_computed: int) -> None:
        pass

    def free(self, table: BlockTable) -> None:
        self.pool.free(table)


class SlidingWindowManager(FullAttentionManager):
    """Paged K/V of the last ``window`` tokens in a fixed pool; no prefix caching (a cached block
    would have to hold the window before it too)."""

    def __init__(self, spec: SlidingWindowSpec, num_blocks: int):
        super().__init__(spec, num_blocks, prefix_caching=False)
        self.window = spec.window

    def advance(self, table: BlockTable, num_computed: int) -> None:
        """Release blocks no later query can see (keys before num_computed - window + 1)."""
        self.pool.release_before(table, num_computed - self.window + 1)


@dataclass
class RecurrentTable:
    """A sequence's state slot. ``current`` is the plane holding the committed state, the state
    after the sequence's first ``num_tokens`` tokens; ``pending`` maps the token counts a running
    step may end at to the planes where the step writes those states. ``restore``: a prefix-cache
    checkpoint the first step starts from (its state is that of the first num_tokens tokens);
    ``checkpointing``: token count -> checkpoint the running step writes at that count."""

    slot: int = -1
    current: int = 0
    num_tokens: int = 0
    pending: dict[int, int] = field(default_factory=dict)
    restore: int = -1
    checkpointing: dict[int, int] = field(default_factory=dict)


class RecurrentStateManager:
    """Fixed-size states in ``num_slots`` slots of ``spec.planes`` planes each.

    A step over rows 0..n-1 of a sequence reads the state from plane ``current``. A verification
    step (the last token plus drafts) writes the state after each row j to its own plane
    ``(current + 1 + j) % planes``, none of which is ``current``; a prefill chunk writes only the
    state after its last row. Rolling back to the accepted count is the index move ``current =
    that row's plane``: no copy, no recompute. The states themselves live in the model's storage,
    indexed by (slot, plane); this class is their bookkeeping."""

    def __init__(self, spec: RecurrentStateSpec, num_slots: int):
        self.spec = spec
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))
        # prefix caching: states at block boundaries, keyed by the full-attention block hash chain
        self.prefix_caching = spec.checkpoints > 0
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> checkpoint; LRU first
        self.hash_of: dict[int, int] = {}  # checkpoint -> its block hash
        self.free_ckpts = list(range(spec.checkpoints - 1, -1, -1))
        self.pins: dict[int, int] = {}  # checkpoint -> tables about to start from it

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def new_table(self) -> RecurrentTable:
        return RecurrentTable()

    def match_prefix(self, table: RecurrentTable, block_hashes: list[int]) -> int:
        """The longest prefix (of the full-attention blocks matched, their chained hashes) whose
        state a checkpoint holds: the table will start from it. Returns its token count."""
        for b in range(len(block_hashes), 0, -1):
            ck = self.by_hash.get(block_hashes[b - 1])
            if ck is not None:
                self.by_hash.move_to_end(block_hashes[b - 1])
                table.restore, table.num_tokens = ck, b * self.spec.block_size
                self.pins[ck] = self.pins.get(ck, 0) + 1
                return table.num_tokens
        return 0

    def checkpoint_rows(self, table: RecurrentTable, num_rows: int, prompt_len: int) -> list[int]:
        """A prefill chunk of num_rows rows: the checkpoint each row writes (-1: none). Rows that
        end a block at a multiple of checkpoint_every, or the prompt's last full block, get one
        (taken free or evicted least-recently-used); the step's states land there."""
        out = [-1] * num_rows
        if not self.prefix_caching:
            return out
        bs, every, start = self.spec.block_size, self.spec.checkpoint_every, table.num_tokens
        last_full = prompt_len // bs * bs
        for n in range((start // bs + 1) * bs, min(start + num_rows, prompt_len) + 1, bs):  # block boundaries
            if not (n % every == 0 or n == last_full):
                continue
            j = n - start - 1
            ck = self._take()
            if ck < 0:
                break
            out[j], table.checkpointing[n] = ck, ck
        return out

    def _take(self) -> int:
        if self.free_ckpts:
            return self.free_ckpts.pop()
        for h, ck in self.by_hash.items():  # least recently used first
            if not self.pins.get(ck):
                del self.by_hash[h], self.hash_of[ck]
                return ck
        return -1

    def register(self, table: RecurrentTable, block_hashes: list[int]) -> None:
        """After a step: the checkpoints it wrote become prefix-cache entries under the hash of
        the block they end (known once the full-attention pool has committed the blocks)."""
        bs = self.spec.block_size
        for n, ck in list(table.checkpointing.items()):
            b = n // bs
            if n > table.num_tokens or b > len(block_hashes):
                continue  # not computed yet (the step ended earlier) or its block is not hashed
            del table.checkpointing[n]
            h = block_hashes[b - 1]
            if h in self.by_hash:  # another sequence checkpointed the same prefix first
                self.free_ckpts.append(ck)
            else:
                self.by_hash[h], self.hash_of[ck] = ck, h

    def consumed(self, table: RecurrentTable) -> None:
        """The table's first step has read its restored checkpoint: unpin it."""
        if table.restore >= 0:
            self.pins[table.restore] -= 1
            if not self.pins[table.restore]:
                del self.pins[table.restore]
            table.restore = -1

    def blocks_to_admit(self, table: RecurrentTable, num_tokens: int) -> int:
        return 0

    def reserve(self, table: RecurrentTable, num_tokens: int) -> None:
        """A slot for the sequence; its state starts zeroed, before token 0 (or from the
        checkpoint a prefix hit restores)."""
        if table.slot < 0:
            if not self.free_slots:
                raise NoFreeBlocks
            table.slot, table.current = self.free_slots.pop(), 0
            table.num_tokens = table.num_tokens if table.restore >= 0 else 0
            table.pending.clear()

    def step_planes(self, table: RecurrentTable, num_rows: int, every_row: bool) -> list[int]:
        """Planes the step writes: one per row (``every_row``: a verification, any row may be the
        last accepted) or only the last row's (a prefill chunk). Returns a plane per written row."""
        written = num_rows if every_row else 1
        if written > self.spec.num_snapshots:
            raise ValueError(f"a step writing {written} states needs more than the "
                             f"{self.spec.num_snapshots} snapshot planes of this state")
        planes = [(table.current + 1 + j) % self.spec.planes for j in range(written)]
        first = table.num_tokens + (1 if every_row else num_rows)
        table.pending = {first + j: p for j, p in enumerate(planes)}
        return planes

    def commit(self, table: RecurrentTable, token_ids: list[int], num_computed: int) -> None:
        pass

    def rollback(self, table: RecurrentTable, num_tokens: int) -> None:
        """Keep the state after the first num_tokens tokens: the committed one, or one the last
        step wrote (then that plane becomes the committed one)."""
        if num_tokens == table.num_tokens:
            table.pending.clear()
            return
        if num_tokens not in table.pending:
            raise ValueError(f"no state after {num_tokens} tokens: the committed state is after "
                             f"{table.num_tokens}, the last step wrote {sorted(table.pending)}")
        table.current, table.num_tokens = table.pending[num_tokens], num_tokens
        table.pending.clear()

    def advance(self, table: RecurrentTable, num_computed: int) -> None:
        self.rollback(table, num_computed)
        self.consumed(table)  # the step that read a restored checkpoint is over

    def free(self, table: RecurrentTable) -> None:
        if table.slot >= 0:
            self.free_slots.append(table.slot)
        self.consumed(table)
        self.free_ckpts += table.checkpointing.values()  # written by a step that never committed them
        table.slot, table.current, table.num_tokens = -1, 0, 0
        table.pending.clear()
        table.checkpointing.clear()
