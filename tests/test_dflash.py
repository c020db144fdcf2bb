"""The dflash block drafter: shapes, masks, the context cache, and losslessness in the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models.layers import linears
from specserve.models.loader import load_model
from specserve.models.transformer import DecoderLayer
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.dflash import DFlashConfig, DFlashDrafter, DFlashModel
from specserve.speculative.drafter_files import save_drafter
from drafter_utils import CHAT4, check_prefix_hits_keep_context, random_drafter, seq_with_output
from tiny_models import FP32, TINY_VOCAB, make_tiny_target

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny"))


def test_train_forward_shapes_and_block_mask(tiny):
    m = random_drafter(tiny, block_size=4)
    b, T, B = 2, 20, 4
    k = len(m.cfg.target_layer_ids)
    hid = torch.randn(b, T, k * 64)
    anchors = torch.tensor([[3, 9, 15], [5, 6, 12]])
    emb = torch.randn(b, 3, 64)
    out = m.train_forward(hid, emb, anchors)
    assert out.shape == (b, 3, B, 64)
    mask = m.block_mask(anchors, T)
    assert mask.shape == (b, 3 * B, T + 3 * B)
    # block 1 of sequence 0 (anchor 9): context 0..8, its own block rows only
    row = mask[0, B]
    assert row[:9].all() and not row[9:T].any()
    assert row[T + B:T + 2 * B].all() and not row[T:T + B].any() and not row[T + 2 * B:].any()


def test_block_sees_context_before_anchor_and_its_block_only(tiny):
    """Perturb inputs and check which outputs change (the training mask, end to end)."""
    m = random_drafter(tiny, block_size=4)
    T = 24
    k = len(m.cfg.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(1, T, k * 64, generator=g)
    anchors = torch.tensor([[6, 12, 18]])
    emb = torch.randn(1, 3, 64, generator=g)
    base = m.train_forward(hid, emb, anchors)

    # the hidden state at position 12 (the anchor of block 1) is not visible to block 1 or 0,
    # only to block 2 (anchor 18 > 12)
    h2 = hid.clone()
    h2[0, 12] += 5.0
    out = m.train_forward(h2, emb, anchors)
    changed = (out - base).abs().amax(dim=(-1, -2))[0]  # per block
    assert changed[0] == 0 and changed[1] == 0 and changed[2] > 1e-3

    # context just before an anchor is visible to that block
    h3 = hid.clone()
    h3[0, 11] += 5.0
    changed = (m.train_forward(h3, emb, anchors) - base).abs().amax(dim=(-1, -2))[0]
    assert changed[0] == 0 and changed[1] > 1e-3 and changed[2] > 1e-3

    # the anchor token of block 1 changes every row of block 1 (non-causal block) and nothing else
    e2 = emb.clone()
    e2[0, 1] += 5.0
    diff = (m.train_forward(hid, e2, anchors) - base).abs().amax(dim=-1)[0]  # [blocks, B]
    assert (diff[1] > 1e-4).all() and diff[0].max() == 0 and diff[2].max() == 0


def test_inference_block_equals_training_block(tiny, tmp_path):
    """The drafter's cached per-sequence context gives the same block as the training forward."""
    m = random_drafter(tiny, block_size=4)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    drafter = DFlashDrafter.load(tmp_path / "d", tiny)
    T = 30
    k = len(m.cfg.target_layer_ids)
    hid = torch.randn(T, k * 64)
    ids = torch.randint(0, 256, (T + 1,)).tolist()
    seq = seq_with_output(ids, 10)
    H = 64
    layer_h = {lid: hid[:, j * H:(j + 1) * H] for j, lid in enumerate(m.cfg.target_layer_ids)}
    # observe in two chunks, as the engine does (prefill, then decode rows)
    drafter.observe(seq, {kk: v[:17] for kk, v in layer_h.items()}, list(range(17)))
    drafter.observe(seq, {kk: v[17:] for kk, v in layer_h.items()}, list(range(17, T)))
    got = drafter.block_hidden(seq)  # anchor = last token at position T
    anchor = torch.tensor([[T]])
    emb = tiny.model.embed(torch.tensor([ids[T]])).float()[None]
    hid_full = torch.cat([hid, torch.zeros(1, k * H)])[None]  # position T's hidden is never visible
    want = m.train_forward(hid_full, emb, anchor)[0, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # re-observing from an earlier position (recompute after preemption) truncates the cache
    drafter.observe(seq, {kk: v[20:] for kk, v in layer_h.items()}, list(range(20, T)))
    torch.testing.assert_close(drafter.block_hidden(seq), got)
    props = drafter.propose([seq], [3])
    assert len(props[0].token_ids) == 3 and props[0].probs is None


def test_queued_context_is_bounded_and_gives_the_eager_block(tiny):
    """Observed rows wait until the sequence drafts; the queue is flushed once it passes the
    context window, and the block equals the one of a drafter that ingested every row at once."""
    cfg = DFlashConfig.for_target(tiny, num_layers=1, block_size=4, context_window=8)
    m = DFlashModel(cfg)
    m.init_weights(1.0, tiny.model.final_norm, 0)
    lazy, eager = DFlashDrafter(m, tiny), DFlashDrafter(m, tiny)
    T = 100
    hid = {lid: torch.randn(T, 64) for lid in cfg.target_layer_ids}
    seq_l, seq_e = seq_with_output(list(range(T + 1)), 10), seq_with_output(list(range(T + 1)), 10)
    for t in range(T):
        rows = {k: v[t:t + 1] for k, v in hid.items()}
        lazy.observe(seq_l, rows, [t])
        eager.observe(seq_e, rows, [t])
        eager._flush(seq_e, eager._state(seq_e))
        st = lazy._state(seq_l)
        assert sum(len(p) for _, p in st.pending) <= cfg.context_window + 64  # bounded queue
    torch.testing.assert_close(lazy.block_hidden(seq_l), eager.block_hidden(seq_e), rtol=1e-4, atol=1e-4)
    st = lazy._state(seq_l)
    assert not st.pending and st.end == T and len(st.rows) <= cfg.context_window + 64


def test_sampling_proposals_carry_probabilities(tiny, tmp_path):
    m = random_drafter(tiny, block_size=5)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    drafter = DFlashDrafter.load(tmp_path / "d", tiny)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=3)
    hid = {lid: torch.randn(12, 64) for lid in m.cfg.target_layer_ids}
    seq = seq_with_output(list(range(40, 53)), 8, params)
    drafter.observe(seq, hid, list(range(12)))
    prop = drafter.propose([seq], [4])[0]
    assert len(prop.token_ids) == 4 and prop.probs.shape == (4, TINY_VOCAB)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(4))
    assert all(prop.probs[j, t] > 0 for j, t in enumerate(prop.token_ids))  # drafts come from their rows
    assert ((prop.probs > 0).sum(-1) <= 50).all()  # top_k applied to the draft rows too


def _engine(target, drafter=None, k: int = 3, seed: int = 0) -> LLMEngine:
    spec = SpeculativeConfig("dflash", num_speculative_tokens=k, model="x", adaptive=False) if drafter else None
    return LLMEngine(target, EngineConfig(max_num_seqs=4, max_model_len=256, seed=seed), spec, drafter)


def _run(engine, prompts, params):
    from engine_utils import run_all

    return run_all(engine, prompts, params)


def test_tiny_greedy_lossless_and_seeded_sampling_reproduces(tiny, tmp_path):
    m = random_drafter(tiny, block_size=4)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 33)]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = _run(_engine(tiny), prompts, greedy)
    eng = _engine(tiny, DFlashDrafter.load(tmp_path / "d", tiny))
    assert _run(eng, prompts, greedy) == plain
    assert eng.totals.draft_tokens > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks
    # temperature > 0: seeded runs with the drafter reproduce exactly
    samp = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    a = _run(_engine(tiny, DFlashDrafter.load(tmp_path / "d", tiny)), prompts, samp)
    b = _run(_engine(tiny, DFlashDrafter.load(tmp_path / "d", tiny)), prompts, samp)
    assert a == b


def test_prefix_cache_hit_keeps_the_drafters_context(tiny, tmp_path):
    m = random_drafter(tiny, block_size=4)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    check_prefix_hits_keep_context(tiny, lambda store: DFlashDrafter.load(tmp_path / "d", tiny, store=store),
                                   "dflash")


@pytest.mark.parametrize("with_drafter", [False, True])
def test_preemption_with_prefix_cache_keeps_outputs(tiny, tmp_path, with_drafter):
    """A pool too small for four sequences preempts some; each resumes from its cached blocks
    (and the drafter from its prefix store) and the outputs stay plain greedy's. A waiting
    sequence must not pin the cached blocks it matched: the running one then preempted itself
    forever."""
    from specserve.speculative.prefix_store import PrefixStore

    m = random_drafter(tiny, block_size=4)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 41, 25, 36)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = _run(_engine(tiny), prompts, params)
    per_token = _engine(tiny).plan.kv_bytes_per_token
    spec = SpeculativeConfig("dflash", num_speculative_tokens=3, model="x", adaptive=False) if with_drafter else None
    drafter = DFlashDrafter.load(tmp_path / "d", tiny, store=PrefixStore(256, 8)) if with_drafter else None
    eng = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_model_len=96, block_size=8,
                                       kv_cache_memory=per_token * 8 * 24), spec, drafter)
    preempted = []
    real = eng.scheduler.preempt

    def preempt(seq):
        preempted.append(seq.request_id)
        assert len(preempted) < 100, "preemption loop"
        real(seq)

    eng.scheduler.preempt = preempt
    assert _run(eng, prompts, params) == want
    assert preempted and eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.stats().num_preemptions == len(preempted)  # what /metrics exports


def test_spec_config_builds_dflash_through_the_registry(tiny, tmp_path):
    from specserve.speculative.registry import build_drafter

    m = random_drafter(tiny)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    d = build_drafter(SpeculativeConfig("dflash", model=str(tmp_path / "d")), tiny, FP32, EngineConfig(), 256)
    assert isinstance(d, DFlashDrafter) and d.hidden_layers == m.cfg.target_layer_ids
    assert d.store is not None and d.kv_bytes() > 0  # the prefix store, counted by the memory plan
    off = build_drafter(SpeculativeConfig("dflash", model=str(tmp_path / "d")), tiny, FP32,
                        EngineConfig(enable_prefix_caching=False), 256)
    assert off.store is None and off.kv_bytes() == 0
    bad = m.cfg.to_json()
    bad["target"] = {**bad["target"], "hidden_size": 128}
    save_drafter(m, bad, tmp_path / "bad")
    with pytest.raises(Exception, match="hidden_size"):
        build_drafter(SpeculativeConfig("dflash", model=str(tmp_path / "bad")), tiny, FP32, EngineConfig(), 256)


# ---- smollm2-135m: greedy with the drafter is plain greedy ------------------------------------
SHIPPED = Path(__file__).resolve().parent.parent / "specserve" / "drafters" / "smollm2-135m-dflash"


def test_lossless_greedy_smollm2_dflash(tmp_path):
    from engine_utils import chat_ids, make_engine, run_all

    if (SHIPPED / "config.json").is_file():
        where = SHIPPED  # the trained drafter: drafts really get accepted
    else:
        from specserve.speculative.train.trainer import make_model

        target = load_model("smollm2-135m")
        m = make_model("dflash", target, layers=1, block_size=8, seed=0)
        save_drafter(m, m.cfg.to_json(), tmp_path / "d")
        where = tmp_path / "d"
    params = SamplingParams(max_tokens=48)
    plain = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4")
    prompts = [chat_ids(plain, t) for t in CHAT4]
    want = run_all(plain, prompts, params)
    spec = json.dumps({"method": "dflash", "model": str(where), "num_speculative_tokens": 7, "adaptive": False})
    eng = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--speculative-config", spec)
    got = run_all(eng, prompts, params)
    assert got == want
    assert eng.totals.draft_tokens > 0 and eng.blocks.num_free == eng.blocks.num_blocks
    if where == SHIPPED:
        assert eng.totals.accepted_tokens > 0


def test_drafts_are_distributed_as_their_returned_probabilities(tiny, tmp_path):
    """At temperature > 0 each draft token is a sample from the probability row returned with it
    (what rejection sampling needs to stay exact)."""
    from test_verify import chi2_pvalue

    m = random_drafter(tiny, block_size=3)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    drafter = DFlashDrafter.load(tmp_path / "d", tiny)
    params = SamplingParams(temperature=1.5, top_k=4, seed=1)
    seq = seq_with_output(list(range(30, 45)), 10, params)
    drafter.observe(seq, {lid: torch.randn(14, 64) for lid in m.cfg.target_layer_ids}, list(range(14)))
    counts = torch.zeros(2, TINY_VOCAB, dtype=torch.float64)
    probs = None
    for _ in range(3000):
        prop = drafter.propose([seq], [2])[0]
        probs = prop.probs if probs is None else probs
        assert torch.equal(prop.probs, probs)  # the state does not drift between proposals
        for j, t in enumerate(prop.token_ids):
            counts[j, t] += 1
    for j in range(2):
        support = probs[j] > 0
        assert chi2_pvalue(counts[j][support], probs[j][support].double()) > 0.001


def test_draft_vocabulary_cuts_the_head_and_stays_lossless(tiny, tmp_path):
    """A dflash drafter with a draft vocabulary ranked by its token counts proposes only tokens of
    that set or of the request, gives the full head's logits on the set, and stays lossless."""
    from specserve.speculative.drafter_files import TOKEN_COUNTS, save_token_counts

    m = random_drafter(tiny, block_size=4)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    counts = torch.zeros(TINY_VOCAB, dtype=torch.int64)
    counts[64:] = torch.arange(TINY_VOCAB - 64, 0, -1)  # ids 0..63 never seen in "training"
    save_token_counts(counts, tmp_path / "d")
    assert (tmp_path / "d" / TOKEN_COUNTS).is_file()
    drafter = DFlashDrafter.load(tmp_path / "d", tiny, draft_vocab_size=128)  # of the tokenizer's 258
    kept = drafter.vocab.member.clone()
    assert drafter.vocab.size == 128 and not kept[:64].any() and kept[256:258].all()  # + the specials
    prompt = list(range(70, 90)) + [5, 6]  # 5 and 6 join the set as the request uses them
    seq = seq_with_output(prompt, len(prompt), SamplingParams(max_tokens=10))
    drafter.observe(seq, {lid: torch.randn(len(prompt), 64) for lid in m.cfg.target_layer_ids},
                    list(range(len(prompt))))
    drafts = drafter.propose([seq], [3])[0].token_ids
    assert drafter.vocab.member[[5, 6]].all() and drafter.vocab.size == 130
    assert all(drafter.vocab.member[t] for t in drafts)
    h = drafter.block_hidden(seq)[1:4]
    full, cut = drafter.head.logits(h), drafter.vocab.logits(h.contiguous())
    member = drafter.vocab.member
    assert torch.equal(cut[:, member], full[:, member]) and torch.isinf(cut[:, ~member]).all()
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 33)]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    eng = _engine(tiny, DFlashDrafter.load(tmp_path / "d", tiny, draft_vocab_size=128))
    assert _run(eng, prompts, greedy) == _run(_engine(tiny), prompts, greedy)
    assert eng.totals.draft_tokens > 0


def test_draft_vocab_size_above_the_vocabulary_is_an_error(tiny, tmp_path):
    """A draft_vocab_size over the vocabulary was ignored silently (the full head); it is an error
    naming both numbers. Exactly the vocabulary means the full head, over the config's default."""
    from specserve.errors import SpecserveError

    m = random_drafter(tiny, block_size=4)
    m.cfg.draft_vocab_size = 128
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    assert DFlashDrafter.load(tmp_path / "d", tiny).vocab.size == 128  # the config's default
    assert DFlashDrafter.load(tmp_path / "d", tiny, draft_vocab_size=TINY_VOCAB).vocab is None
    with pytest.raises(SpecserveError, match=f"draft_vocab_size 1000 is larger .*{TINY_VOCAB} tokens"):
        DFlashDrafter.load(tmp_path / "d", tiny, draft_vocab_size=1000)


def test_int8_drafter_weights_are_lossless(tiny, tmp_path):
    """"quantization": "int8" runs the drafter's linears in the CPU kernels' int8 format: close to
    the float32 block, lossless in the engine, and any other format is a clear error."""
    from specserve.speculative.registry import build_drafter

    m = random_drafter(tiny, block_size=4)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    spec = SpeculativeConfig("dflash", model=str(tmp_path / "d"), quantization="int8", num_speculative_tokens=3)
    d8 = build_drafter(spec, tiny, FP32, EngineConfig(), 256)
    assert {lin.format for lin in linears(d8.net)} == {"int8"}  # the family's layer modules, in int8
    assert isinstance(d8.net.stack.layers[0], DecoderLayer)
    assert d8.weight_bytes() < DFlashDrafter.load(tmp_path / "d", tiny).weight_bytes() / 3
    prompt = list(range(40, 60))
    blocks = []
    for d in (d8, DFlashDrafter.load(tmp_path / "d", tiny)):
        seq = seq_with_output(prompt, len(prompt), SamplingParams(max_tokens=4))
        g = torch.Generator().manual_seed(3)
        d.observe(seq, {lid: torch.randn(len(prompt), 64, generator=g) for lid in m.cfg.target_layer_ids},
                  list(range(len(prompt))))
        blocks.append(d.block_hidden(seq))
    assert (blocks[0] - blocks[1]).abs().max() < 0.1 * blocks[1].abs().max()
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17)]
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    eng = _engine(tiny, build_drafter(spec, tiny, FP32, EngineConfig(), 256))
    assert _run(eng, prompts, greedy) == _run(_engine(tiny), prompts, greedy) and eng.totals.draft_tokens > 0
    with pytest.raises(Exception, match="int8"):
        build_drafter(SpeculativeConfig("dflash", model=str(tmp_path / "d"), quantization="q4_0"), tiny, FP32,
                      EngineConfig(), 256)


def test_int8_export_rebuilds_the_int8_inference_weights(tiny, tmp_path):
    """save_drafter(..., torch.int8) stores matrices as per-row int8 + scale; loading them gives
    weights within half a step of the originals, and the int8 inference path rebuilds exactly
    the int8 values it would have made from the float weights."""
    from specserve.kernels import ops
    from specserve.speculative.drafter_files import load_state

    m = random_drafter(tiny, block_size=4)
    save_drafter(m, m.cfg.to_json(), tmp_path / "f")
    save_drafter(m, m.cfg.to_json(), tmp_path / "q", torch.int8)
    size = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("q", "f")}
    assert size["q"] < size["f"] / 3
    _, state = load_state(tmp_path / "q")
    for name, w in m.state_dict().items():
        step = w.abs().amax(dim=-1, keepdim=True) / 127 if w.dim() == 2 else 0.0
        assert state[name].shape == w.shape and ((state[name] - w).abs() <= step / 2 + 1e-7).all(), name
    d8 = DFlashDrafter.load(tmp_path / "q", tiny, weights="int8")
    gate = d8.net.stack.layers[0].mlp.gate_up.weight  # gate|up fused, rows of each quantized alone
    assert torch.equal(gate.q[:m.cfg.intermediate_size], ops.Int8Weight.from_float(m.layers[0].gate.weight).q)


def test_pick_tokens_p_min_stops_at_the_first_unsure_draft():
    """p_min cuts the drafts at the first row whose top probability is under it: the softmax of
    the (processed) logits when greedy, the returned warped rows when sampling; the same rule
    with logit_bias (the per-row path) and after earlier drafts (a chain)."""
    from specserve.speculative.drafter import pick_tokens

    logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.2, 0.0], [9.0, 0.0, 0.0]])  # row 1 is unsure
    greedy = seq_with_output([0, 1], 2)
    assert pick_tokens(greedy, logits, None).token_ids == [0, 1, 0]
    assert pick_tokens(greedy, logits, None, p_min=0.5).token_ids == [0]
    assert pick_tokens(greedy, logits, None, p_min=0.3).token_ids == [0, 1, 0]  # row 1's top is 0.36
    biased = seq_with_output([0, 1], 2, SamplingParams(logit_bias=((1, 3.0),)))  # row 1 becomes sure of token 1
    assert pick_tokens(biased, logits, None, p_min=0.5).token_ids == [0, 1, 0]
    pen = seq_with_output([0, 1], 2, SamplingParams(frequency_penalty=2.0, presence_penalty=2.0))
    assert pick_tokens(pen, logits, None, p_min=0.45).token_ids == [0, 1, 0]
    assert pick_tokens(pen, logits, None, earlier=[0, 0], p_min=0.45).token_ids == []  # earlier drafts count
    samp = seq_with_output([0, 1], 2, SamplingParams(temperature=1.0, seed=0))
    full = pick_tokens(samp, logits, torch.Generator().manual_seed(0))
    cut = pick_tokens(samp, logits, torch.Generator().manual_seed(0), p_min=0.5)
    assert len(full.token_ids) == 3 and cut.token_ids == full.token_ids[:1]
    assert torch.equal(cut.probs, full.probs[:1]) and float(full.probs[1].max()) < 0.5 <= float(full.probs[0].max())


def test_an_always_unsure_drafter_is_left_idle_by_the_adaptive_policy(tiny, tmp_path):
    """With draft_p_min above what a random drafter gives, nearly every draft is cut to nothing.
    Such a step verifies nothing, and the acceptance estimate used to stay where it was, so the
    policy kept paying for a drafter forward every step; now a cut counts as a miss and the
    drafter is asked only when the policy probes (cheap costs, so only the estimate decides)."""
    from specserve.speculative.adaptive import PROBE_EVERY

    m = random_drafter(tiny, block_size=4)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    drafter = DFlashDrafter.load(tmp_path / "d", tiny, p_min=0.999)
    spec = SpeculativeConfig("dflash", num_speculative_tokens=3, model="x", adaptive=True)
    eng = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256), spec, drafter)
    eng.cost.table = {w: 0.010 + 0.0001 * w for w in range(1, 5)}
    eng.cost.add = lambda width, seconds, keys=None: None  # these costs stay
    eng.policy.draft_cost = lambda k: 0.0001
    asked, steps = [], [0]  # per step: whether the drafter was asked for a draft
    propose, schedule = drafter.propose, eng.scheduler.schedule

    def scheduled(drafting, **kw):
        steps[0] += 1
        asked.append(0)
        return schedule(drafting, **kw)

    def proposing(seqs, ks):
        asked[-1] = sum(k > 0 for k in ks)
        return propose(seqs, ks)

    eng.scheduler.schedule, drafter.propose = scheduled, proposing
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    out = [t for o in eng.generate(prompt, SamplingParams(max_tokens=120, ignore_eos=True)) for t in o.new_token_ids]
    assert out == _run(_engine(tiny), [prompt], SamplingParams(max_tokens=120, ignore_eos=True))[0]
    assert eng.totals.draft_tokens < 10  # hardly ever sure: nearly nothing drafted
    decode = asked[1:]  # the first step prefills the prompt
    assert decode[0] == 1 and sum(decode[-60:]) <= 60 // PROBE_EVERY + 1, asked  # then only probes
