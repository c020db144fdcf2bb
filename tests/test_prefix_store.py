"""The drafters' prefix store: LRU capacity, token re-check, and chains ending at a block."""

from __future__ import annotations

import torch

from specserve.speculative.prefix_store import PrefixStore


def _rows(i: int) -> list[torch.Tensor]:
    return [torch.full((4, 2), float(i))]


def test_lru_evicts_the_least_recently_used_block():
    st = PrefixStore(capacity_blocks=2, block_size=4)
    st.put(1, (1,), _rows(1))
    st.put(2, (2,), _rows(2))
    assert st.get(1, (1,)) is not None  # 1 is now the most recent
    st.put(3, (3,), _rows(3))
    assert len(st) == 2 and st.get(2, (2,)) is None and st.get(1, (1,)) is not None


def test_a_hash_hit_with_other_tokens_is_a_miss():
    st = PrefixStore(4, 4)
    st.put(7, (1, 2, 3, 4), _rows(7))
    assert st.get(7, (1, 2, 3, 5)) is None
    assert st.get(7, (1, 2, 3, 4))[0][0, 0] == 7


def test_chain_is_the_longest_stored_run_before_the_block():
    st = PrefixStore(16, 2)
    tokens = list(range(12))  # blocks of 2 tokens
    hashes = [100 + i for i in range(6)]
    for i in (0, 2, 3, 4):  # block 1 missing
        st.put(hashes[i], tuple(tokens[2 * i:2 * i + 2]), _rows(i))
    lo, rows = st.chain(hashes, tokens, end_block=5, max_blocks=10)
    assert lo == 2 and [int(r[0][0, 0]) for r in rows] == [2, 3, 4]
    lo, rows = st.chain(hashes, tokens, end_block=5, max_blocks=2)  # the window caps the run
    assert lo == 3 and len(rows) == 2
    assert st.chain(hashes, tokens, end_block=2, max_blocks=10) == (2, [])  # block 1 is missing
