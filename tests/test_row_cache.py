"""RowCache (engine/cache/rows.py): the DFlash / MTP context rows, against torch.cat-built tensors."""

import random

import pytest
import torch

from specserve.engine.cache.rows import MIN_CAPACITY, RowCache


def test_random_appends_rollbacks_and_window_moves_match_concatenation():
    rng = random.Random(0)
    rows = RowCache()
    ref_k, ref_v, start = torch.zeros(0, 2, 4), torch.zeros(0, 2, 4), 5
    rows.reset(start)
    for _ in range(400):
        op = rng.random()
        if op < 0.6:  # append m rows (a verified step, a prefill chunk)
            m = rng.choice([1, 1, 3, 40, 130])
            k, v = torch.randn(m, 2, 4), torch.randn(m, 2, 4)
            rows.append([k, v])
            ref_k, ref_v = torch.cat([ref_k, k]), torch.cat([ref_v, v])
        elif op < 0.8:  # roll back to a position (rejected drafts, a recompute)
            pos = rng.randint(start - 2, start + ref_k.shape[0] + 2)
            rows.truncate(pos)
            keep = min(max(pos - start, 0), ref_k.shape[0])
            ref_k, ref_v = ref_k[:keep], ref_v[:keep]
        else:  # the window moves forward
            n = rng.randint(0, ref_k.shape[0])
            rows.drop_front(n)
            ref_k, ref_v, start = ref_k[n:], ref_v[n:], start + n
        assert rows.start == start and rows.end == start + ref_k.shape[0] and len(rows) == ref_k.shape[0]
        if len(rows):
            k, v = rows.parts()
            assert k.is_contiguous() and torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_draft_rows_are_dropped_by_an_index_move_and_the_buffer_is_reused():
    rows = RowCache()
    rows.reset(0, [torch.randn(10, 3)])
    before = rows.parts()[0].clone()
    buf = rows._bufs[0]
    for _ in range(5):  # a draft chain: append a row per draft, then roll back to the verified end
        rows.append([torch.randn(1, 3)])
    rows.truncate(10)
    assert torch.equal(rows.parts()[0], before) and rows._bufs[0] is buf
    assert buf.shape[0] == MIN_CAPACITY  # no reallocation for a few rows


def test_reset_empties_and_a_new_layout_needs_an_empty_cache():
    rows = RowCache()
    rows.reset(7, [torch.ones(2, 3)])
    with pytest.raises(ValueError):
        rows.append([torch.ones(1, 4)])
    rows.reset(20)
    assert len(rows) == 0 and rows.end == 20
    rows.append([torch.ones(1, 4)])  # empty: any layout
    assert rows.parts()[0].shape == (1, 4)
