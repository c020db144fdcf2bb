"""Hybrid Gated-DeltaNet models (Qwen3.5) against transformers' own modelling code, and lossless.

* A tiny random ``Qwen3_5ForCausalLM`` (both layer types, GQA in both, conv kernel 4, partial
  rotary) saved with ``save_pretrained`` and read by our loader: fp32 logits match transformers'
  within 1e-4 (relative to the logits' scale) at every prompt position and over 64 decode steps
  through our paged KV cache and recurrent-state slots; greedy tokens equal ``generate``'s.
* The DeltaNet kernel is exact under any chunking: the rows of a sequence split anywhere, fed
  from the snapshots the kernel wrote, give the bits of one call (C and torch paths).
* Speculation is lossless: every drafter's greedy output equals plain greedy decoding, alone and
  in a batch of 8, with chunked prefill and a quantized KV cache; random traffic with random
  drafts, preemptions and aborts keeps outputs and frees every state slot.
* Bad checkpoints fail at load, naming what is wrong.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("transformers.models.qwen3_5")

from specserve.engine.config import EngineConfig  # noqa: E402
from specserve.engine.llm_engine import plan_for  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.errors import ModelLoadError  # noqa: E402
from specserve.kernels import ops  # noqa: E402
from specserve.models.layers import linears  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.ngram import NgramDrafter  # noqa: E402
from engine_utils import drafter_makers, logits_of_every_position  # noqa: E402
from hybrid_utils import (DATA, LLAMA_CPP, RTOL, OracleDrafter, copy_checkpoint, greedy_outputs,  # noqa: E402
                          make_engine, random_prompt, repetitive)
from tiny_models import FP32, make_tiny_target  # noqa: E402

@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1)


# ---- against transformers --------------------------------------------------------------------
def test_config_reads_layer_types_and_shapes(hybrid):
    ours, hf = hybrid
    cfg = ours.config
    assert cfg.arch == "qwen35" and cfg.hybrid
    assert cfg.layer_types == tuple(hf.config.layer_types)
    assert cfg.linear_layers == (0, 2) and cfg.attention_layers == (1, 3)
    dn = cfg.deltanet
    assert (dn.num_k_heads, dn.num_v_heads, dn.k_head_dim, dn.v_head_dim, dn.conv_kernel) == (2, 4, 16, 16, 4)
    assert cfg.rotary_dim == 8 and cfg.attn_output_gate and not cfg.tie_embeddings


def test_logits_match_transformers_prefill_and_64_decode_steps(hybrid):
    ours, hf = hybrid
    ids = random_prompt(0, 48)
    eng = make_engine(ours)
    eng.add_request("a", ids, SamplingParams(max_tokens=65, ignore_eos=True))
    got, seq = logits_of_every_position(eng, "a")  # the prompt in one forward, logits at every position
    tokens = ids + seq.output_ids
    assert len(seq.output_ids) == 65
    with torch.no_grad():
        ref = hf(torch.tensor([tokens[:-1]])).logits[0]  # [len - 1, V]
    assert got.shape == ref.shape
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= RTOL * scale, float((got - ref).abs().max() / scale)


def test_prompt_logprobs_match_transformers_in_chunks_after_a_cache_hit(hybrid):
    """Prompt logprobs (vLLM's prompt_logprobs, completions' echo + logprobs) are transformers'
    log-softmax at every prompt position, computed in chunks of 16 rows after the same prompt's
    blocks and state checkpoints went into the prefix cache (such a request matches none of them)."""
    ours, hf = hybrid
    ids = random_prompt(7, 60)
    eng = make_engine(ours, max_num_batched_tokens=16, max_step_ms=0)
    greedy_outputs(eng, [ids], 4)
    outs = list(eng.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=2), request_id="p"))
    lps = outs[-1].prompt_logprobs
    assert lps[0] is None and len(lps) == len(ids) and outs[-1].cached_tokens == 0
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)  # [len - 1, V]
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor([lp.logprob for lp in lps[1:]])
    assert (got - want).abs().max() <= RTOL * ref.abs().max(), float((got - want).abs().max())
    assert [lp.top[0][0] for lp in lps[1:]] == ref.argmax(-1).tolist()


def test_greedy_equals_transformers_generate(hybrid):
    ours, hf = hybrid
    for seed in range(3):
        ids = random_prompt(10 + seed, 20 + 7 * seed)
        with torch.no_grad():
            x = torch.tensor([ids])  # (an explicit mask: generate would mask the pad id 0 in a prompt)
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False)
            ref = ref[0, len(ids):].tolist()  # generate stops at the eos token, we ignore it
        assert len(ref) >= 16 and greedy_outputs(make_engine(ours), [ids], 48)[0][:len(ref)] == ref


# ---- the kernel ------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["c", "torch"])
def test_deltanet_kernel_exact_under_any_chunking(impl):
    if impl == "c" and not ops.kernels_available():
        pytest.skip("no C compiler")
    hk, hv, dk, dv, k, n = 2, 4, 16, 8, 4, 23
    c = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(3)
    qkv, a, b = torch.randn(n, c, generator=g), torch.randn(n, hv, generator=g), torch.randn(n, hv, generator=g)
    wt, A, dt = torch.randn(k, c, generator=g) * 0.5, -torch.rand(hv, generator=g) * 4, torch.randn(hv, generator=g)
    heads = (hk, hv, dk, dv)
    conv_s, ssm_s = [torch.empty(k - 1, c) for _ in range(n)], [torch.empty(hv, dk, dv) for _ in range(n)]
    whole = ops.gated_delta(qkv, a, b, wt, A, dt, heads, None, None, conv_s, ssm_s, impl=impl)
    rnd = random.Random(0)
    for _ in range(4):
        cuts = sorted(rnd.sample(range(1, n), 4))
        parts, start = [], 0
        conv_in = ssm_in = None
        for end in cuts + [n]:
            co, so = torch.empty(k - 1, c), torch.empty(hv, dk, dv)
            rows = end - start
            parts.append(ops.gated_delta(qkv[start:end], a[start:end], b[start:end], wt, A, dt, heads, conv_in,
                                         ssm_in, [None] * (rows - 1) + [co], [None] * (rows - 1) + [so], impl=impl))
            assert torch.equal(co, conv_s[end - 1]) and torch.equal(so, ssm_s[end - 1])
            conv_in, ssm_in, start = co, so, end
        assert torch.equal(torch.cat(parts), whole)


def test_rollback_fuzz_states_equal_plain_decoding_bit_for_bit(hybrid):
    """Random verification widths and accepted counts, two sequences sharing each forward: the
    state the cache keeps after every step (read back from the plane the rollback picked) is, bit
    for bit, the state after the same tokens fed in one plain prefill."""
    from specserve.engine.model_runner import BatchEntry, build_forward_batch
    from specserve.models.hybrid import RecurrentStates
    from specserve.models.kv_cache import KVCache

    ours, _ = hybrid
    cfg, model = ours.config, ours.model
    n, planes, bs = 60, 6, 16
    seqs = [random_prompt(70 + i, n) for i in range(2)]
    blocks = [list(range(i * 8, i * 8 + 8)) for i in range(2)]

    def fresh():
        kv = KVCache.allocate(cfg, 16, bs)
        kv.states = RecurrentStates.allocate(cfg, 2, planes)
        return kv

    def run(kv, entries):
        model.forward(build_forward_batch(entries, bs, 8, [0], torch.device("cpu")), kv)

    # reference: each sequence alone, one prefill writing the state after every row ("planes" 0..n-1)
    ref = []
    for toks, blk in zip(seqs, blocks):
        kv = KVCache.allocate(cfg, 16, bs)
        kv.states = RecurrentStates.allocate(cfg, 1, n)
        run(kv, [BatchEntry(toks, 0, [blk], (0, -1, list(range(n)), -1, [-1] * n))])
        ref.append(kv.states)
    rnd = random.Random(1)
    kv = fresh()
    done, current = [0, 0], [-1, -1]  # tokens whose state is committed, the plane holding it
    while min(done) < n - 1:
        entries, picks, live = [], {}, [s for s in range(2) if done[s] < n]
        for s in live:
            w = min(rnd.randrange(1, 6), n - done[s])
            rows = [(current[s] + 1 + j) % planes for j in range(w)]
            entries.append(BatchEntry(seqs[s][done[s]:done[s] + w], done[s], [blocks[s]],
                                      (s, current[s], rows, -1, [-1] * w)))
            picks[s] = rows[rnd.randrange(w)]
        run(kv, entries)
        for s in live:
            kept = (picks[s] - current[s] - 1) % planes + 1  # rows kept: the accepted count + 1
            done[s], current[s] = done[s] + kept, picks[s]
            for i in cfg.linear_layers:
                assert torch.equal(kv.states.ssm[i][s, current[s]], ref[s].ssm[i][0, done[s] - 1])
                assert torch.equal(kv.states.conv[i][s, current[s]], ref[s].conv[i][0, done[s] - 1])


@pytest.mark.parametrize("v_tiled", [False, True])
def test_deltanet_kernel_c_and_torch_match_transformers_recurrence(v_tiled):
    """Both paths against transformers' own recurrent gated delta rule (conv + SiLU + L2 norms
    done the reference's way), value heads in either order."""
    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    hk, hv, dk, dv, k, n = 2, 4, 16, 8, 4, 11
    c = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(5)
    qkv, a, b = torch.randn(n, c, generator=g), torch.randn(n, hv, generator=g), torch.randn(n, hv, generator=g)
    w, A, dt = torch.randn(c, k, generator=g) * 0.5, -torch.rand(hv, generator=g) * 3, torch.randn(hv, generator=g)
    x = F.silu(F.conv1d(qkv.T[None], w[:, None, :], padding=k - 1, groups=c)[..., :n])[0].T
    q, kk, v = x.split((hk * dk, hk * dk, hv * dv), -1)
    q, kk = q.view(1, n, hk, dk), kk.view(1, n, hk, dk)
    if v_tiled:  # v head h reads k head h % hk: the reference's grouped layout after reordering q / k
        order = torch.arange(hv) % hk
        q, kk = q[:, :, order], kk[:, :, order]
    ref, state = torch_recurrent_gated_delta_rule(q, kk, v.view(1, n, hv, dv), (A * F.softplus(a + dt))[None],
                                                  b.sigmoid()[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    impls = ["torch"] + (["c"] if ops.kernels_available() else [])
    for impl in impls:
        last = torch.empty(hv, dk, dv)
        out = ops.gated_delta(qkv, a, b, w.T.contiguous(), A, dt, (hk, hv, dk, dv), None, None,
                              [None] * (n - 1) + [torch.empty(k - 1, c)], [None] * (n - 1) + [last],
                              v_tiled=v_tiled, impl=impl)
        torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last, state[0], rtol=1e-5, atol=1e-5)


# ---- lossless --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["oracle", "ngram", "suffix", "draft_model", "mtp", "dflash"])
def test_speculation_is_lossless_alone_and_in_a_batch_of_8(hybrid, draft, method):
    ours, _ = hybrid
    prompts = [repetitive(s) if s % 2 else random_prompt(s, 30 + s) for s in range(8)]
    plain = greedy_outputs(make_engine(ours, max_num_seqs=8), prompts, 40)
    truth = {tuple(p): out for p, out in zip(prompts, plain)}

    def make():
        if method == "oracle":
            # a fixed draft length: the adaptive one follows this machine's timings, and at short drafts
            # the deeper positions (the planes checked below) may never be reached
            return SpeculativeConfig("ngram", num_speculative_tokens=5, adaptive=False), OracleDrafter(truth)
        return drafter_makers(DATA / "hf", ours, draft, 256)[method]()

    eng = make_engine(ours, *make(), max_num_seqs=8)
    assert greedy_outputs(eng, prompts, 40) == plain
    assert eng.totals.draft_tokens > 0
    if method == "oracle":  # accepted counts 0 .. 3 at least: rollbacks to several snapshot planes
        assert eng.totals.accepted_tokens > 0 and all(n > 0 for n in eng.totals.accepted_per_pos[:3])
    assert greedy_outputs(make_engine(ours, *make()), prompts[1:2], 40) == plain[1:2]
    assert eng.cache.idle()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_chunked_prefill_and_batch_invariance(hybrid, kv_dtype):
    ours, _ = hybrid
    prompts = [random_prompt(40 + s, 70 + 9 * s) for s in range(4)]
    alone = [greedy_outputs(make_engine(ours, kv_cache_dtype=kv_dtype), [p], 24)[0] for p in prompts]
    eng = make_engine(ours, kv_cache_dtype=kv_dtype, max_num_batched_tokens=16, max_step_ms=0)
    chunked = greedy_outputs(eng, prompts, 24)
    assert chunked == alone


def test_prefix_cache_hits_restore_state_checkpoints(hybrid):
    """A long shared system prompt is a cache hit up to the last state checkpoint inside it (one
    every 512 tokens, and at each prompt's last full block); a follow-up turn hits the previous
    prompt's last full block. Outputs equal those without prefix caching."""
    ours, _ = hybrid
    system = random_prompt(90, 600)
    a, b = system + random_prompt(91, 40), system + random_prompt(92, 30)
    off = make_engine(ours, max_model_len=1024, enable_prefix_caching=False)
    want = [_greedy_one(off, p, 16, f"o{i}") for i, p in enumerate((a, b))]
    eng = make_engine(ours, max_model_len=1024)
    outs = []
    for i, p in enumerate((a, b)):
        res = list(eng.generate(p, SamplingParams(max_tokens=16, ignore_eos=True), request_id=f"c{i}"))
        outs.append(([t for o in res for t in o.new_token_ids], res[-1].cached_tokens))
    assert [o[0] for o in outs] == want
    assert outs[0][1] == 0 and outs[1][1] == 512  # the checkpoint at 512 of the 592 shared full-block tokens
    turn2 = a + want[0] + random_prompt(93, 20)
    res = list(eng.generate(turn2, SamplingParams(max_tokens=16, ignore_eos=True), request_id="t2"))
    assert [t for o in res for t in o.new_token_ids] == _greedy_one(off, turn2, 16, "o-t2")
    assert res[-1].cached_tokens == len(a) // 16 * 16  # the last full block of the first turn's prompt
    assert eng.cache.idle()


def test_random_traffic_keeps_outputs_and_frees_state_slots(hybrid, draft):
    ours, _ = hybrid
    ref, preempted, hits, eng_cached = make_engine(ours, max_num_seqs=4, enable_prefix_caching=False), 0, 0, {}
    for trial in range(3):
        rnd = random.Random(trial)
        method = ("ngram", "draft_model", "suffix")[trial]
        spec, drafter = drafter_makers(DATA / "hf", ours, draft, 256)[method]()
        seqs = rnd.choice([2, 3])
        probe = plan_for(ours, EngineConfig(max_model_len=96, block_size=8, max_num_seqs=seqs), spec, drafter)
        memory = probe.kv_bytes_per_token * 8 * 14 + probe.state_bytes  # a tight pool: preemptions happen
        eng = make_engine(ours, spec, drafter, max_num_seqs=seqs, max_model_len=96, block_size=8,
                      max_num_batched_tokens=rnd.choice([8, 24]), max_step_ms=0, kv_cache_memory=memory)
        reqs, got, aborted = {}, {}, set()
        bases = [repetitive(trial), random_prompt(50 + trial, 60)]
        while len(reqs) < 10 or eng.has_work():
            if len(reqs) < 10 and rnd.random() < 0.5:
                rid = f"t{trial}-{len(reqs)}"
                base = bases[rnd.randrange(len(bases))]  # shared prefixes: prefix-cache hits and checkpoints
                ids = base[:rnd.randrange(8, len(base))] + random_prompt(rnd.randrange(99), rnd.randrange(1, 12))
                reqs[rid], got[rid] = (ids, rnd.randrange(1, 30)), []
                eng.add_request(rid, ids, SamplingParams(max_tokens=reqs[rid][1], ignore_eos=True))
            if reqs and rnd.random() < 0.03:
                rid = rnd.choice(list(reqs))
                if eng.abort(rid) is not None:
                    aborted.add(rid)
            for out in eng.step():
                got[out.request_id] += out.new_token_ids
                eng_cached[out.request_id] = out.cached_tokens
        for rid, (ids, n) in reqs.items():
            if rid not in aborted:
                assert got[rid] == _greedy_one(ref, ids, n, f"ref-{rid}"), rid
        assert eng.cache.idle()
        preempted += eng.num_preemptions
        hits += sum(1 for rid in reqs if eng_cached.get(rid))
    assert preempted > 0 and hits > 0


def _greedy_one(eng, ids, n, rid):
    return [t for o in eng.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
            for t in o.new_token_ids]


def test_memory_plan_counts_the_states(hybrid):
    ours, _ = hybrid
    ecfg = EngineConfig(max_model_len=256, max_num_seqs=3)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    plan = plan_for(ours, ecfg, spec, NgramDrafter(1, 3))
    dn = ours.config.deltanet
    per = 2 * ((dn.conv_kernel - 1) * dn.conv_dim + dn.num_v_heads * dn.k_head_dim * dn.v_head_dim) * 4
    assert (plan.state_slots, plan.state_planes, plan.state_checkpoints) == (4, 6, 8)
    assert plan.state_bytes == (4 * 6 + 8) * per
    assert plan.total_bytes >= plan.state_bytes + plan.pool_bytes
    # only the full-attention layers keep K/V
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    eng = make_engine(ours, spec, NgramDrafter(1, 3), max_num_seqs=3)
    assert eng.kv.states.nbytes() == plan.state_bytes and eng.cache.prefix_caching
    off = plan_for(ours, EngineConfig(max_model_len=256, max_num_seqs=3, enable_prefix_caching=False), spec, None)
    assert off.state_checkpoints == 0 and off.state_bytes == 4 * 6 * per
    # a --kv-cache-memory that the states alone fill leaves no KV pool: refused at start-up
    from specserve.errors import SpecserveError

    with pytest.raises(SpecserveError, match="kv-cache-memory"):
        make_engine(ours, spec, NgramDrafter(1, 3), max_num_seqs=3, kv_cache_memory=plan.state_bytes)


def test_input_projections_fused_or_not_give_the_same_bits(monkeypatch):
    """llama-quantize gives some layers' q|k|v another format than z / b / a, so the input
    projection cannot be one call there: z | b | a are then one call, else three. Each way gives
    the same logits, bit for bit (every output is reduced on its own); so does gated attention's
    q | k | v as one call or three."""
    from specserve.models import layers as L
    from specserve.models.hybrid import GatedAttention, GatedDeltaNet

    fused = L.Linear.fused.__func__

    def refuse(n):  # Linear.fused refusing n weights at once, as for weights in two formats
        return classmethod(lambda cls, raws, *a, **kw: None if len(raws) >= n else fused(cls, raws, *a, **kw))

    path = str(DATA / "tiny-qwen35-q8_0.gguf")
    ids = random_prompt(5, 24)
    outs = []
    for n in (9, 4, 3):  # all four in one call; z | b | a; all apart
        monkeypatch.setattr(L.Linear, "fused", refuse(n))
        model = load_model(path)
        mixers = [m for m in model.model.modules() if isinstance(m, GatedDeltaNet)]
        assert all((m.in_proj is not None, m.zba is not None) == (n == 9, n == 4) for m in mixers)
        attention = [m for m in model.model.modules() if isinstance(m, GatedAttention)]
        assert attention and all((m.qkv is not None) == (n > 3) for m in attention)  # q | k | v one call or three
        outs.append(logits_of_every_position_in(model, ids))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def logits_of_every_position_in(model, ids: list[int]) -> torch.Tensor:
    eng = make_engine(model)
    eng.add_request("a", ids, SamplingParams(max_tokens=4, ignore_eos=True))
    return logits_of_every_position(eng, "a")[0]


def test_no_full_attention_layer_needs_no_kv_pool(tmp_path):
    """Every layer a Gated DeltaNet one (no K/V per token): the engine plans no KV bytes, starts,
    and its greedy tokens are transformers'."""
    from tiny_models import make_tiny_hybrid

    ours, hf = make_tiny_hybrid(tmp_path, mtp=False, num_hidden_layers=2, layer_types=["linear_attention"] * 2)
    assert plan_for(ours, EngineConfig(max_model_len=256, max_num_seqs=2), None, None).kv_bytes_per_token == 0
    ids = random_prompt(4, 12)
    got = greedy_outputs(make_engine(ours), [ids], 10)[0]
    want = list(ids)  # (transformers' generate needs an attention layer in its cache: greedy by hand)
    with torch.no_grad():
        for _ in range(10):
            want.append(int(hf(torch.tensor([want]), use_cache=False).logits[0, -1].argmax()))
    assert got == want[12:]


# ---- GGUF: llama.cpp's converter and llama.cpp itself as the oracle ----------------------------
def test_gguf_f32_greedy_equals_llama_cpp_and_the_safetensors(hybrid):
    """The F32 GGUF (converted by llama.cpp, value heads in its tiled order, norms with the 1
    folded in, -exp(A_log)) gives llama.cpp's greedy tokens for all 32 tokens of every prompt, and
    the logits of the safetensors it came from."""
    ours = load_model(str(DATA / "tiny-qwen35-f32.gguf"), FP32)
    assert ours.config.deltanet.v_tiled and ours.config.mtp_layers == 1 and ours.config.num_layers == 4
    ref = LLAMA_CPP["files"]["tiny-qwen35-f32.gguf"]
    got = [greedy_outputs(make_engine(ours), [p], LLAMA_CPP["tokens"])[0] for p in LLAMA_CPP["prompts"]]
    assert got == ref and all(len(r) == LLAMA_CPP["tokens"] for r in ref)
    assert got == [greedy_outputs(make_engine(hybrid[0]), [p], LLAMA_CPP["tokens"])[0] for p in LLAMA_CPP["prompts"]]


def test_gguf_q8_0_loads_and_stays_lossless(hybrid):
    """Q8_0 kept as the file's blocks: the first tokens agree with llama.cpp on the same file
    (both quantize activations to 8 bits, not identically, and a random model's greedy path is
    full of near-ties), and speculation is lossless on it."""
    ours = load_model(str(DATA / "tiny-qwen35-q8_0.gguf"))  # default CPU weights: the file's Q8_0 blocks
    assert any(lin.format == "Q8_0" for lin in linears(ours.model.layers[0]))
    ref = LLAMA_CPP["files"]["tiny-qwen35-q8_0.gguf"]
    prompts = LLAMA_CPP["prompts"]
    plain = greedy_outputs(make_engine(ours, max_num_seqs=4), prompts, LLAMA_CPP["tokens"])
    assert all(a[:4] == b[:4] for a, b in zip(plain, ref))
    truth = {tuple(p): out for p, out in zip(prompts, plain)}
    eng = make_engine(ours, SpeculativeConfig("ngram", num_speculative_tokens=4), OracleDrafter(truth), max_num_seqs=4)
    assert greedy_outputs(eng, prompts, LLAMA_CPP["tokens"]) == plain


def test_gguf_of_another_architecture_names_it(tmp_path):
    """A qwen35 GGUF without its ssm.* keys fails at load, naming them."""
    from gguf import GGUFReader, GGUFWriter

    src = GGUFReader(str(DATA / "tiny-qwen35-f32.gguf"))
    w = GGUFWriter(str(tmp_path / "bad.gguf"), "qwen35")
    for key, field in src.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "qwen35.ssm.")):
            continue
        w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in src.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="ssm.group_count"):
        load_model(str(tmp_path / "bad.gguf"), FP32)


# ---- bad checkpoints -------------------------------------------------------------------------
def test_unknown_layer_type_fails_at_load(hybrid, tmp_path):
    dst, cfg = copy_checkpoint(hybrid, tmp_path)
    cfg["layer_types"][1] = "mamba2"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="mamba2"):
        load_model(str(dst), FP32)


@pytest.mark.parametrize("apart", [False, True])
def test_a_q_projection_without_its_gate_fails_at_load(hybrid, tmp_path, monkeypatch, apart):
    """Gated attention's q projection holds query and gate per head (twice q_size rows): one with
    the query only is named at load, whether q | k | v load as one linear or three."""
    from safetensors.torch import load_file, save_file

    from specserve.models import layers as L

    dst, cfg = copy_checkpoint(hybrid, tmp_path)
    i = cfg["layer_types"].index("full_attention")
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(str(f))
    name = f"model.layers.{i}.self_attn.q_proj.weight"
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2].contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    if apart:
        monkeypatch.setattr(L.Linear, "fused", classmethod(lambda cls, raws, *a, **kw: None))
    with pytest.raises(ModelLoadError, match="gated attention wants a q projection"):
        load_model(str(dst), FP32)


def test_missing_tensor_fails_at_load(hybrid, tmp_path):
    from safetensors.torch import load_file, save_file

    dst, _ = copy_checkpoint(hybrid, tmp_path)
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["model.layers.2.linear_attn.conv1d.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.2.ssm_conv1d"):
        load_model(str(dst), FP32)
