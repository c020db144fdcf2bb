"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables,
rollback of the last tokens, and prefix caching.

Prefix caching: a full block is keyed by a hash chained from the previous block's hash,
the block's token ids and the model's identity. A request reuses the longest chain of
cached blocks; a hit re-checks the token ids, so a hash collision is a miss, never wrong
KV. Blocks nobody references stay cached and are evicted least-recently-used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


def default_hash(prev: int, tokens: tuple[int, ...], salt: str) -> int:
    return hash((prev, salt, tokens))


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class BlockTable:
    """One sequence's blocks; ``num_hashed`` leading blocks are registered in the cache."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


HOLE = -1  # a table entry whose block was released (slid out of a sliding window)


class NoFreeBlocks(Exception):
    """The pool cannot hold what was asked; the scheduler waits or preempts."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, salt: str = "",
                 hash_fn: Callable[[int, tuple[int, ...], str], int] = default_hash):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # never cached, stack
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.prefix_caching = enable_prefix_caching
        self.salt = salt
        self.hash_fn = hash_fn

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free_ids:
            bid = self.free_ids.pop()
        elif self.evictable:
            bid, _ = self.evictable.popitem(last=False)
            blk = self.blocks[bid]
            if blk.hash is not None and self.cached.get(blk.hash) == bid:
                del self.cached[blk.hash]
            blk.hash, blk.token_ids = None, None
        else:
            raise NoFreeBlocks
        self.blocks[bid].ref_count = 1
        return bid

    def _release(self, bid: int) -> None:
        if bid == HOLE:
            return
        blk = self.blocks[bid]
        blk.ref_count -= 1
        assert blk.ref_count >= 0, f"block {bid} released twice"
        if blk.ref_count == 0:
            if blk.hash is not None and self.cached.get(blk.hash) == bid:
                self.evictable[bid] = None
            else:
                blk.hash, blk.token_ids = None, None
                self.free_ids.append(bid)

    def _cached_blocks(self, token_ids: list[int]):
        """(block id, hash) of the longest cached prefix of ``token_ids``, leaving its last token out."""
        bs, prev = self.block_size, 0
        for i in range((len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(prev, toks, self.salt)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != toks:
                return  # a miss, or a hash collision caught by the re-check
            yield bid, h
            prev = h

    def cached_prefix(self, token_ids: list[int]) -> int:
        """The token count match_prefix would attach, attaching nothing."""
        return sum(1 for _ in self._cached_blocks(token_ids)) * self.block_size if self.prefix_caching else 0

    def match_prefix(self, table: BlockTable, token_ids: list[int]) -> int:
        """Attach cached blocks for the longest cached prefix; returns the cached token count.

        At least one token is left uncached so the last prompt token is computed (its logits
        are needed). ``table`` must be empty.
        """
        assert not table.blocks
        if not self.prefix_caching:
            return 0
        for bid, h in self._cached_blocks(token_ids):
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                self.evictable.pop(bid, None)
            blk.ref_count += 1
            table.blocks.append(bid)
            table.hashes.append(h)
        return len(table.blocks) * self.block_size

    def ensure_capacity(self, table: BlockTable, num_tokens: int) -> None:
        """Grow the table to hold num_tokens tokens; all-or-nothing."""
        need = self.blocks_needed(num_tokens) - len(table.blocks)
        if need <= 0:
            return
        if need > self.num_free:
            raise NoFreeBlocks
        table.blocks.extend(self._take() for _ in range(need))

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.num_free

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Roll back: keep only the blocks needed for num_tokens tokens (bookkeeping, no copy)."""
        keep = self.blocks_needed(num_tokens)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())
        full = num_tokens // self.block_size
        del table.hashes[full:]
        for bid in table.blocks[full:]:  # a partial block will be written again: uncache it
            blk = self.blocks[bid]
            if blk.hash is not None and self.cached.get(blk.hash) == bid and blk.ref_count == 1:
                del self.cached[blk.hash]
                blk.hash, blk.token_ids = None, None

    def release_before(self, table: BlockTable, num_tokens: int) -> None:
        """Return the blocks that hold only tokens before index num_tokens to the pool (a sliding
        window moved past them); their table entries become HOLE so later indices stay put."""
        for i in range(min(max(num_tokens, 0) // self.block_size, len(table.blocks))):
            if table.blocks[i] != HOLE:
                self._release(table.blocks[i])
                table.blocks[i] = HOLE

    def free(self, table: BlockTable) -> None:
        for bid in reversed(table.blocks):
            self._release(bid)
        table.blocks.clear()
        table.hashes.clear()

    def commit(self, table: BlockTable, token_ids: list[int], num_computed: int) -> None:
        """Register every full block whose KV is computed, so later requests can reuse it."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        prev = table.hashes[-1] if table.hashes else 0
        for i in range(len(table.hashes), num_computed // bs):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(prev, toks, self.salt)
            bid = table.blocks[i]
            blk = self.blocks[bid]
            if h not in self.cached:
                self.cached[h] = bid
                blk.hash, blk.token_ids = h, toks
            table.hashes.append(h)
            prev = h

    def check_invariants(self) -> None:
        """For tests: every block is free, evictable or referenced, exactly once."""
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "duplicate free block"
        assert not free & set(self.evictable), "block both free and evictable"
        for blk in self.blocks:
            in_free = blk.id in free or blk.id in self.evictable
            assert in_free == (blk.ref_count == 0), f"block {blk.id} ref {blk.ref_count} free={in_free}"
