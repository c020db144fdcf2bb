"""A drafter's own state for prefix-cached blocks, so a prefix-cache hit keeps its context.

Drafters that read the target's hidden states (dflash, MTP) see only the tokens the target
computes. When a request starts from the prefix cache, the target skips the cached blocks and
the drafter would start with no context at all: a shared system prompt, the second turn of a
chat or a repeated prompt would leave it drafting blind to the cached part. The store keeps, per full block, the rows a drafter derived from those
tokens (its context K/V), keyed by the target's chained block hash: the hash covers every token
before the block too, so equal hashes mean equal rows at equal positions.

Least-recently-used blocks are evicted past ``capacity_blocks``; a hit re-checks the block's
token ids, as the target's block manager does, so a hash collision is a miss.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

PREFIX_STORE_TOKENS = 16384  # default capacity, in tokens (the drafter's rows of 1024 blocks of 16)


class PrefixStore:
    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._rows: OrderedDict[int, tuple[tuple[int, ...], list[torch.Tensor]]] = OrderedDict()

    @classmethod
    def for_engine(cls, ecfg) -> "PrefixStore | None":
        """The store a drafter gets in an engine (EngineConfig): none without prefix caching."""
        if not ecfg.enable_prefix_caching:
            return None
        return cls(PREFIX_STORE_TOKENS // ecfg.block_size, ecfg.block_size)

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, block_hash: int, tokens: tuple[int, ...], rows: list[torch.Tensor]) -> None:
        """rows: the drafter's tensors of the block, each [block_size, ...] (stored as given)."""
        if block_hash in self._rows:
            self._rows.move_to_end(block_hash)
            return
        self._rows[block_hash] = (tokens, rows)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def get(self, block_hash: int, tokens: tuple[int, ...]) -> list[torch.Tensor] | None:
        hit = self._rows.get(block_hash)
        if hit is None or hit[0] != tokens:
            return None
        self._rows.move_to_end(block_hash)
        return hit[1]

    def chain(self, hashes: list[int], token_ids: list[int], end_block: int, max_blocks: int) -> tuple[int, list]:
        """The longest run of stored blocks ending just before block ``end_block`` (at most
        ``max_blocks``): (index of its first block, [rows of each block, in order])."""
        bs, got = self.block_size, []
        i = end_block - 1
        while i >= 0 and len(got) < max_blocks and i < len(hashes):
            rows = self.get(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]))
            if rows is None:
                break
            got.append(rows)
            i -= 1
        return i + 1, got[::-1]
