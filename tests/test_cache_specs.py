"""Per-layer cache specs, their managers and the coordinator, without a model."""

from __future__ import annotations

import random

import pytest

from specserve.engine.block_manager import NoFreeBlocks
from specserve.engine.cache import (CacheCoordinator, FullAttentionSpec, RecurrentStateManager, RecurrentStateSpec,
                                    SlidingWindowSpec, layer_cache_specs)
from specserve.engine.cache.coordinator import SequenceCache
from specserve.models.config import ModelConfig


class _Seq:  # what the coordinator reads of a sequence
    def __init__(self, tokens):
        self.token_ids, self.num_computed, self.cache = list(tokens), 0, SequenceCache()

    @property
    def cache_keys(self):  # (no images: the token ids)
        return self.token_ids


def _state_spec(snapshots: int = 4) -> RecurrentStateSpec:
    return RecurrentStateSpec(layers=(0, 2), state_bytes=1000, num_snapshots=snapshots)


def test_recurrent_rollback_is_an_index_move_to_the_accepted_rows_snapshot():
    m = RecurrentStateManager(_state_spec(4), num_slots=2)
    t = m.new_table()
    m.reserve(t, 10)
    assert t.slot >= 0 and m.num_free == 1
    assert m.step_planes(t, 10, every_row=False) == [1]  # a prefill chunk: only its last state
    m.rollback(t, 10)
    assert (t.current, t.num_tokens) == (1, 10)
    planes = m.step_planes(t, 4, every_row=True)  # the last token plus 3 drafts
    assert planes == [2, 3, 4, 0] and t.current not in planes
    m.rollback(t, 10 + 1 + 1)  # one draft accepted: the state after row 1
    assert (t.current, t.num_tokens) == (3, 12)
    assert 3 not in m.step_planes(t, 4, every_row=True)
    with pytest.raises(ValueError, match="no state after 20 tokens"):
        m.rollback(t, 20)
    with pytest.raises(ValueError, match="snapshot planes"):
        m.step_planes(t, 5, every_row=True)
    m.free(t)
    assert m.num_free == 2 and t.slot == -1


def test_recurrent_planes_never_overwrite_the_committed_state_fuzz():
    """Random prefills, verifications and acceptances: the committed plane is never a plane the
    step writes, and after rollback the committed plane is the one written for the kept row."""
    rnd = random.Random(0)
    for k in (1, 3, 7):
        m = RecurrentStateManager(_state_spec(k + 1), num_slots=1)
        t = m.new_table()
        m.reserve(t, 1)
        for _ in range(200):
            if rnd.random() < 0.3:
                n = rnd.randint(1, 50)
                planes = m.step_planes(t, n, every_row=False)
                assert t.current not in planes
                m.rollback(t, t.num_tokens + n)
                assert t.current == planes[0]
            else:
                rows = rnd.randint(1, k + 1)
                planes = m.step_planes(t, rows, every_row=True)
                assert t.current not in planes and len(set(planes)) == rows
                keep = rnd.randint(1, rows)
                m.rollback(t, t.num_tokens + keep)
                assert t.current == planes[keep - 1]


def test_recurrent_slots_run_out_and_the_memory_counts_every_plane():
    spec = _state_spec(3)
    m = RecurrentStateManager(spec, num_slots=1)
    a, b = m.new_table(), m.new_table()
    m.reserve(a, 5)
    with pytest.raises(NoFreeBlocks):
        m.reserve(b, 5)
    assert spec.planes == 4 and spec.bytes_for(2) == 2 * 4 * 1000


def _cfg(**kw) -> ModelConfig:
    base = dict(arch="gemma3", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=6,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_eps=1e-6, rope_theta=1e4, max_position=1024)
    base.update(kw)
    return ModelConfig(**base)


def test_layer_cache_specs_put_sliding_layers_in_their_own_group():
    cfg = _cfg(sliding_window=32, layer_is_sliding=(True, True, False, True, True, False))
    full, window = layer_cache_specs(cfg, 16, 100, window_paged=True)
    assert isinstance(window, SlidingWindowSpec) and window.window == 32
    assert sorted(full.layers + window.layers) == list(range(6))
    assert all(cfg.sliding(i) for i in window.layers) and not any(cfg.sliding(i) for i in full.layers)
    assert full.bytes_per_token == 100 * len(full.layers)
    (only,) = layer_cache_specs(cfg, 16, 100, window_paged=False)
    assert type(only) is FullAttentionSpec and only.layers == tuple(range(6))


def test_coordinator_reserves_rolls_back_and_frees_every_group():
    specs = (FullAttentionSpec((0, 1), 4, 8), SlidingWindowSpec((2,), 4, 4, window=8), _state_spec(4))
    c = CacheCoordinator.build(specs, (16, 8, 2), prefix_caching=True)
    assert not c.prefix_caching  # a window or a state cannot serve a prefix hit: off for all
    seq = _Seq(range(30))
    c.reserve(seq, 21)
    full, window, state = seq.cache.tables
    assert len(full.blocks) == 6 and len(window.blocks) == 6 and state.slot >= 0
    seq.num_computed = 20
    c.step_planes(seq, 20, every_row=False)
    c.advance(seq)  # the window released what no later query sees
    assert sum(b >= 0 for b in window.blocks) <= 8 // 4 + 1 and state.num_tokens == 20
    c.reserve(seq, 25)
    c.step_planes(seq, 4, every_row=True)  # the last token and 3 drafts
    seq.num_computed = 22  # two of the four rows kept
    c.rollback(seq)
    c.advance(seq)
    assert len(full.blocks) == 6 and state.num_tokens == 22
    c.free(seq)
    assert c.idle()


def test_coordinator_prefix_hits_with_full_attention_only():
    c = CacheCoordinator.build((FullAttentionSpec((0,), 4, 8),), (16,), prefix_caching=True)
    a = _Seq(range(13))
    c.reserve(a, 13)
    a.num_computed = 13
    c.commit(a)
    c.free(a)
    b = _Seq(list(range(13)) + [99])
    assert c.match_prefix(b) == 12 and c.has_tables(b)
    c.free(b)
    assert c.idle()
