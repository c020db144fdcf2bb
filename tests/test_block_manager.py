"""Block manager: allocation, rollback, freeing, prefix caching, eviction, collisions."""

import random

import pytest

from specserve.engine.block_manager import HOLE, BlockManager, BlockTable, NoFreeBlocks


def test_random_operations_leak_nothing():
    rng = random.Random(0)
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    tables: list[tuple[BlockTable, list[int]]] = []  # (table, token count holder)
    for _ in range(1000):
        op = rng.choice(["alloc", "append", "rollback", "slide", "free"])
        if op == "alloc" or not tables:
            t = BlockTable()
            n = rng.randint(1, 20)
            try:
                bm.ensure_capacity(t, n)
                tables.append((t, [n]))
            except NoFreeBlocks:
                assert bm.blocks_needed(n) > bm.num_free
        elif op == "append":
            t, n = rng.choice(tables)
            want = n[0] + rng.randint(1, 9)
            try:
                bm.ensure_capacity(t, want)
                n[0] = want
            except NoFreeBlocks:
                assert len(t.blocks) == bm.blocks_needed(n[0])  # all-or-nothing
        elif op == "rollback":
            t, n = rng.choice(tables)
            n[0] = max(0, n[0] - rng.randint(0, 9))
            bm.truncate(t, n[0])
            assert len(t.blocks) == bm.blocks_needed(n[0])
        elif op == "slide":  # a sliding window moved past the first tokens: their blocks go back
            t, n = rng.choice(tables)
            cut = rng.randint(0, n[0])
            bm.release_before(t, cut)
            assert all(b == HOLE for b in t.blocks[:cut // 4])
        else:
            t, n = tables.pop(rng.randrange(len(tables)))
            bm.free(t)
        bm.check_invariants()
        used = sum(b != HOLE for t, _ in tables for b in t.blocks)
        assert bm.num_free == 64 - used
    for t, _ in tables:
        bm.free(t)
    assert bm.num_free == 64
    bm.check_invariants()


def _run_prefix(bm: BlockManager, tokens: list[int]) -> tuple[BlockTable, int]:
    t = BlockTable()
    cached = bm.match_prefix(t, tokens)
    bm.ensure_capacity(t, len(tokens))
    bm.commit(t, tokens, len(tokens))
    return t, cached


def test_prefix_hit_and_miss_exact_counts():
    bm = BlockManager(32, 4)
    a = list(range(10))  # 2 full blocks + 2 tokens
    t1, c1 = _run_prefix(bm, a)
    assert c1 == 0
    t2, c2 = _run_prefix(bm, a + [99, 98])
    assert c2 == 8 and t2.blocks[:2] == t1.blocks[:2]
    t3, c3 = _run_prefix(bm, [0, 1, 2, 3, 7, 7, 7, 7, 7])
    assert c3 == 4  # first block shared, second differs
    t4, c4 = _run_prefix(bm, list(range(8)))
    assert c4 == 4  # the last token is always computed: the second block is recomputed
    for t in (t1, t2, t3, t4):
        bm.free(t)
    bm.check_invariants()
    assert bm.num_free == 32


def test_lru_eviction_under_pressure():
    bm = BlockManager(4, 2)
    t1, _ = _run_prefix(bm, [1, 2, 3, 4, 5])  # 3 blocks, 2 cached full blocks
    bm.free(t1)
    assert bm.num_free == 4 and len(bm.evictable) == 2
    t2, c = _run_prefix(bm, [9, 9, 9, 9, 9, 9, 9])  # needs all 4 blocks: evicts the cached ones
    assert c == 0 and len(t2.blocks) == 4
    bm.free(t2)
    t3, c3 = _run_prefix(bm, [1, 2, 3, 4, 5])
    assert c3 == 0  # evicted, so a miss, never stale data
    bm.free(t3)
    bm.check_invariants()


def test_hash_collision_is_a_miss():
    bm = BlockManager(16, 2, hash_fn=lambda prev, toks, salt: 42)  # every block collides
    t1, _ = _run_prefix(bm, [1, 2, 3])
    t2, c = _run_prefix(bm, [5, 6, 7])
    assert c == 0  # same hash, different tokens: the re-check refuses the hit
    assert set(t1.blocks).isdisjoint(t2.blocks)
    t3, c3 = _run_prefix(bm, [1, 2, 8])
    assert c3 == 2 and t3.blocks[0] == t1.blocks[0]


def test_salt_separates_models():
    bm = BlockManager(16, 2)
    t1, _ = _run_prefix(bm, [1, 2, 3])
    bm.salt = "other-model"
    _, c = _run_prefix(bm, [1, 2, 3])
    assert c == 0
    bm.free(t1)


def test_truncate_keeps_committed_hashes_consistent():
    bm = BlockManager(16, 4)
    t = BlockTable()
    toks = list(range(12))
    bm.ensure_capacity(t, 12)
    bm.commit(t, toks, 12)
    assert len(t.hashes) == 3
    bm.truncate(t, 9)
    assert len(t.blocks) == 3 and len(t.hashes) == 2
    with pytest.raises(NoFreeBlocks):
        bm.ensure_capacity(t, 16 * 4 + 1)
    bm.free(t)
    bm.check_invariants()
