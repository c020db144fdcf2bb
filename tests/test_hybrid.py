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
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("transformers.models.qwen3_5")

from specserve.engine.config import EngineConfig  # noqa: E402
from specserve.engine.llm_engine import LLMEngine, plan_for  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.errors import ModelLoadError  # noqa: E402
from specserve.kernels import ops  # noqa: E402
from specserve.models.layers import linears  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.drafter import Drafter, Proposal  # noqa: E402
from specserve.speculative.mtp import MTPDrafter  # noqa: E402
from specserve.speculative.ngram import NgramDrafter  # noqa: E402
from engine_utils import drafter_makers, logits_of_every_position  # noqa: E402
from tiny_models import FP32, make_tiny_qwen3_next, make_tiny_target  # noqa: E402

RTOL = 1e-4


DATA = Path(__file__).resolve().parent / "data" / "tiny_qwen35"  # made by tests/data/make_tiny_qwen35.py
LLAMA_CPP = json.loads((DATA / "llama_cpp_tokens.json").read_text())


@pytest.fixture(scope="module")
def hybrid():
    """The committed tiny checkpoint (tests/tiny_models.make_tiny_hybrid, mtp.* included): ours and
    transformers' Qwen3_5ForCausalLM over the same files."""
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(DATA / "hf"), dtype=torch.float32).eval()
    return load_model(str(DATA / "hf"), FP32), hf


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _engine(model, spec=None, drafter=None, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    return LLMEngine(model, EngineConfig(**kw), spec, drafter)


def _greedy(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    return [got[f"r{i}"] for i in range(len(prompts))]


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
    ids = _prompt(0, 48)
    eng = _engine(ours)
    eng.add_request("a", ids, SamplingParams(max_tokens=65, ignore_eos=True))
    got, seq = logits_of_every_position(eng, "a")  # the prompt in one forward, logits at every position
    tokens = ids + seq.output_ids
    assert len(seq.output_ids) == 65
    with torch.no_grad():
        ref = hf(torch.tensor([tokens[:-1]])).logits[0]  # [len - 1, V]
    assert got.shape == ref.shape
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= RTOL * scale, float((got - ref).abs().max() / scale)


def test_greedy_equals_transformers_generate(hybrid):
    ours, hf = hybrid
    for seed in range(3):
        ids = _prompt(10 + seed, 20 + 7 * seed)
        with torch.no_grad():
            x = torch.tensor([ids])  # (an explicit mask: generate would mask the pad id 0 in a prompt)
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False)
            ref = ref[0, len(ids):].tolist()  # generate stops at the eos token, we ignore it
        assert len(ref) >= 16 and _greedy(_engine(ours), [ids], 48)[0][:len(ref)] == ref


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
    seqs = [_prompt(70 + i, n) for i in range(2)]
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
class OracleDrafter(Drafter):
    """Proposes a random number of the true greedy continuation's next tokens, then random ones:
    every accepted count from 0 to k occurs, so every snapshot plane gets rolled back to."""

    name = "oracle"

    def __init__(self, truth: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.truth, self.rnd = truth, random.Random(seed)

    def propose(self, seqs, num_tokens):
        out = []
        for seq, k in zip(seqs, num_tokens):
            cont = self.truth.get(tuple(seq.prompt_ids), [])[len(seq.output_ids):]
            good = self.rnd.randrange(k + 1)
            out.append(Proposal(cont[:good] + [self.rnd.randrange(256) for _ in range(k - min(good, len(cont)))]))
        return out


def _repetitive(seed: int) -> list[int]:
    rnd = random.Random(seed)
    unit = [rnd.randrange(256) for _ in range(rnd.randrange(3, 7))]
    return (unit * 12)[:rnd.randrange(20, 60)]


@pytest.mark.parametrize("method", ["oracle", "ngram", "suffix", "draft_model", "mtp", "dflash"])
def test_speculation_is_lossless_alone_and_in_a_batch_of_8(hybrid, draft, method):
    ours, _ = hybrid
    prompts = [_repetitive(s) if s % 2 else _prompt(s, 30 + s) for s in range(8)]
    plain = _greedy(_engine(ours, max_num_seqs=8), prompts, 40)
    truth = {tuple(p): out for p, out in zip(prompts, plain)}

    def make():
        if method == "oracle":
            return SpeculativeConfig("ngram", num_speculative_tokens=5), OracleDrafter(truth)
        return drafter_makers(DATA / "hf", ours, draft, 256)[method]()

    eng = _engine(ours, *make(), max_num_seqs=8)
    assert _greedy(eng, prompts, 40) == plain
    assert eng.totals.draft_tokens > 0
    if method == "oracle":  # accepted counts 0 .. 3 at least: rollbacks to several snapshot planes
        assert eng.totals.accepted_tokens > 0 and all(n > 0 for n in eng.totals.accepted_per_pos[:3])
    assert _greedy(_engine(ours, *make()), prompts[1:2], 40) == plain[1:2]
    assert eng.cache.idle()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_chunked_prefill_and_batch_invariance(hybrid, kv_dtype):
    ours, _ = hybrid
    prompts = [_prompt(40 + s, 70 + 9 * s) for s in range(4)]
    alone = [_greedy(_engine(ours, kv_cache_dtype=kv_dtype), [p], 24)[0] for p in prompts]
    chunked = _greedy(_engine(ours, kv_cache_dtype=kv_dtype, max_num_batched_tokens=16, max_step_ms=0), prompts, 24)
    assert chunked == alone


def test_prefix_cache_hits_restore_state_checkpoints(hybrid):
    """A long shared system prompt is a cache hit up to the last state checkpoint inside it (one
    every 512 tokens, and at each prompt's last full block); a follow-up turn hits the previous
    prompt's last full block. Outputs equal those without prefix caching."""
    ours, _ = hybrid
    system = _prompt(90, 600)
    a, b = system + _prompt(91, 40), system + _prompt(92, 30)
    off = _engine(ours, max_model_len=1024, enable_prefix_caching=False)
    want = [_greedy_one(off, p, 16, f"o{i}") for i, p in enumerate((a, b))]
    eng = _engine(ours, max_model_len=1024)
    outs = []
    for i, p in enumerate((a, b)):
        res = list(eng.generate(p, SamplingParams(max_tokens=16, ignore_eos=True), request_id=f"c{i}"))
        outs.append(([t for o in res for t in o.new_token_ids], res[-1].cached_tokens))
    assert [o[0] for o in outs] == want
    assert outs[0][1] == 0 and outs[1][1] == 512  # the checkpoint at 512 of the 592 shared full-block tokens
    turn2 = a + want[0] + _prompt(93, 20)
    res = list(eng.generate(turn2, SamplingParams(max_tokens=16, ignore_eos=True), request_id="t2"))
    assert [t for o in res for t in o.new_token_ids] == _greedy_one(off, turn2, 16, "o-t2")
    assert res[-1].cached_tokens == len(a) // 16 * 16  # the last full block of the first turn's prompt
    assert eng.cache.idle()


def test_random_traffic_keeps_outputs_and_frees_state_slots(hybrid, draft):
    ours, _ = hybrid
    ref, preempted, hits, eng_cached = _engine(ours, max_num_seqs=4, enable_prefix_caching=False), 0, 0, {}
    for trial in range(3):
        rnd = random.Random(trial)
        method = ("ngram", "draft_model", "suffix")[trial]
        spec, drafter = drafter_makers(DATA / "hf", ours, draft, 256)[method]()
        seqs = rnd.choice([2, 3])
        probe = plan_for(ours, EngineConfig(max_model_len=96, block_size=8, max_num_seqs=seqs), spec, drafter)
        memory = probe.kv_bytes_per_token * 8 * 14 + probe.state_bytes  # a tight pool: preemptions happen
        eng = _engine(ours, spec, drafter, max_num_seqs=seqs, max_model_len=96, block_size=8,
                      max_num_batched_tokens=rnd.choice([8, 24]), max_step_ms=0, kv_cache_memory=memory)
        reqs, got, aborted = {}, {}, set()
        bases = [_repetitive(trial), _prompt(50 + trial, 60)]
        while len(reqs) < 10 or eng.has_work():
            if len(reqs) < 10 and rnd.random() < 0.5:
                rid = f"t{trial}-{len(reqs)}"
                base = bases[rnd.randrange(len(bases))]  # shared prefixes: prefix-cache hits and checkpoints
                ids = base[:rnd.randrange(8, len(base))] + _prompt(rnd.randrange(99), rnd.randrange(1, 12))
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
    eng = _engine(ours, spec, NgramDrafter(1, 3), max_num_seqs=3)
    assert eng.kv.states.nbytes() == plan.state_bytes and eng.cache.prefix_caching
    off = plan_for(ours, EngineConfig(max_model_len=256, max_num_seqs=3, enable_prefix_caching=False), spec, None)
    assert off.state_checkpoints == 0 and off.state_bytes == 4 * 6 * per
    # a --kv-cache-memory that the states alone fill leaves no KV pool: refused at start-up
    from specserve.errors import SpecserveError

    with pytest.raises(SpecserveError, match="kv-cache-memory"):
        _engine(ours, spec, NgramDrafter(1, 3), max_num_seqs=3, kv_cache_memory=plan.state_bytes)


# ---- GGUF: llama.cpp's converter and llama.cpp itself as the oracle ----------------------------
def test_gguf_f32_greedy_equals_llama_cpp_and_the_safetensors(hybrid):
    """The F32 GGUF (converted by llama.cpp, value heads in its tiled order, norms with the 1
    folded in, -exp(A_log)) gives llama.cpp's greedy tokens for all 32 tokens of every prompt, and
    the logits of the safetensors it came from."""
    ours = load_model(str(DATA / "tiny-qwen35-f32.gguf"), FP32)
    assert ours.config.deltanet.v_tiled and ours.config.mtp_layers == 1 and ours.config.num_layers == 4
    ref = LLAMA_CPP["files"]["tiny-qwen35-f32.gguf"]
    got = [_greedy(_engine(ours), [p], LLAMA_CPP["tokens"])[0] for p in LLAMA_CPP["prompts"]]
    assert got == ref and all(len(r) == LLAMA_CPP["tokens"] for r in ref)
    assert got == [_greedy(_engine(hybrid[0]), [p], LLAMA_CPP["tokens"])[0] for p in LLAMA_CPP["prompts"]]


def test_gguf_q8_0_loads_and_stays_lossless(hybrid):
    """Q8_0 kept as the file's blocks: the first tokens agree with llama.cpp on the same file
    (both quantize activations to 8 bits, not identically, and a random model's greedy path is
    full of near-ties), and speculation is lossless on it."""
    ours = load_model(str(DATA / "tiny-qwen35-q8_0.gguf"))  # default CPU weights: the file's Q8_0 blocks
    assert any(lin.format == "Q8_0" for lin in linears(ours.model.layers[0]))
    ref = LLAMA_CPP["files"]["tiny-qwen35-q8_0.gguf"]
    prompts = LLAMA_CPP["prompts"]
    plain = _greedy(_engine(ours, max_num_seqs=4), prompts, LLAMA_CPP["tokens"])
    assert all(a[:4] == b[:4] for a, b in zip(plain, ref))
    truth = {tuple(p): out for p, out in zip(prompts, plain)}
    eng = _engine(ours, SpeculativeConfig("ngram", num_speculative_tokens=4), OracleDrafter(truth), max_num_seqs=4)
    assert _greedy(eng, prompts, LLAMA_CPP["tokens"]) == plain


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


# ---- the checkpoint's own MTP head -----------------------------------------------------------
def _reference_mtp_logits(hf, ids: list[int], ckpt: Path = DATA / "hf") -> torch.Tensor:
    """The MTP head (mtp.* of the checkpoint) in transformers' own modules (Qwen3.5's or
    Qwen3-Next's): row i reads token i's embedding and the target's final-normed hidden state at
    i - 1, through its norms, fc, one gated-attention decoder layer (causal over its rows; a MoE
    MLP for Qwen3-Next), its norm and the LM head."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    w = {k[4:]: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if k.startswith("mtp.")}
    cfg = hf.config
    nxt = cfg.model_type == "qwen3_next"
    layer_cls, norm_cls = (Qwen3NextDecoderLayer, Qwen3NextRMSNorm) if nxt else (Qwen3_5DecoderLayer, Qwen3_5RMSNorm)
    layer = layer_cls(cfg, cfg.layer_types.index("full_attention")).eval()
    sd = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
    if nxt:  # transformers keeps its experts as 3-D tensors
        e = cfg.num_experts
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"mlp.experts.{j}.gate_proj.weight"),
                                                                 sd.pop(f"mlp.experts.{j}.up_proj.weight")])
                                                      for j in range(e)])
        sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{j}.down_proj.weight") for j in range(e)])
    layer.load_state_dict(sd)
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        norms[n].load_state_dict({"weight": w[f"{n}.weight"]})
    x = torch.tensor([ids])
    with torch.no_grad():
        h = hf.model(x).last_hidden_state  # after the final norm
        e = hf.model.embed_tokens(x)
        z = torch.cat([norms["pre_fc_norm_embedding"](e[:, 1:]), norms["pre_fc_norm_hidden"](h[:, :-1])], -1)
        z = z @ w["fc.weight"].T
        pos = torch.arange(1, len(ids))[None]
        n = len(ids) - 1
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(z, hf.model.rotary_emb(z, pos), attention_mask=mask, position_ids=pos)
        return hf.lm_head(norms["norm"](out))[0]  # [n, V]: row j predicts token j + 2


@pytest.mark.parametrize("source", ["hf", "tiny-qwen35-f32.gguf", "qwen3_next", "tiny-qwen3next-f32.gguf"])
def test_checkpoint_mtp_head_matches_transformers_modules(hybrid, qwen3_next, source):
    """The head read from the safetensors (mtp.*, zero-centred norms), from llama.cpp's GGUF
    (blk.4.nextn.*, norms folded), or Qwen3-Next's (a mixture-of-experts layer; from GGUF its
    experts merged into 3-D tensors) computes what transformers' modules compute."""
    if source == "qwen3_next":
        ours, hf = qwen3_next
        ckpt, target = ours.resolved.path, ours
    elif "qwen3next" in source:
        ckpt = DATA / "next_hf"
        hf = transformers.Qwen3NextForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        target = load_model(str(DATA / source), FP32)
    else:
        hf, ckpt, target = hybrid[1], DATA / "hf", load_model(str(DATA / source), FP32)
    ids = _prompt(7, 30)
    ref = _reference_mtp_logits(hf, ids, ckpt)
    head = MTPDrafter.load(None, target).net  # the family's gated-attention layer (and MoE) in float32
    assert head.cfg.output_gate and head.cfg.rotary_dim == 8
    eng = _engine(target)
    eng.add_request("a", ids, SamplingParams(max_tokens=1))
    eng.scheduler.admit()
    rows = eng.scheduler.schedule(drafting=False)
    batch = eng.runner.batch(rows)
    hidden = target.model.forward(batch, eng.kv).final_hidden  # [T, H] after the final norm
    with torch.no_grad():
        emb = target.model.embed(torch.tensor(ids[1:]))
        g, _ = head(emb, hidden[:-1], torch.arange(1, len(ids)), None, None, causal=True)
        got = target.model.logits(head.out_norm(g))
    assert (got - ref).abs().max() <= RTOL * ref.abs().max()


def test_trained_mtp_head_keeps_the_sampling_distribution(hybrid, tmp_path):
    """train-drafter --method mtp on the hybrid target: greedy stays lossless, its mean acceptance
    length is what the training reports, and at temperature > 0 the joint distribution of the
    first three tokens is the target's exact one."""
    import subprocess
    import sys

    from test_suffix import sampled_joint_pvalue

    ours, _ = hybrid
    prompts = tmp_path / "p.json"
    rnd = random.Random(0)
    prompts.write_text(json.dumps([{"prompt": "".join(rnd.choice("abcdefgh ") for _ in range(rnd.randrange(20, 60)))}
                                   for _ in range(40)]))
    out = subprocess.run([sys.executable, "-m", "specserve", "train-drafter", "--model", str(DATA / "hf"), "--method",
                          "mtp", "--out", str(tmp_path / "mtp"), "--prompts", str(prompts), "--steps", "150",
                          "--max-new-tokens", "48", "--batch", "8", "--seq-len", "96", "--quantization", "none"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = next(ln for ln in (out.stderr + out.stdout).splitlines() if "final validation mean acceptance length" in ln)
    print(report)  # the trained head's mean acceptance length (pytest -s shows it)
    lines = (out.stderr + out.stdout).splitlines()
    untrained = next(ln for ln in lines if "step 0 validation mean acceptance length" in ln)
    length = lambda line: float(line.split("acceptance length")[1].split()[0])  # noqa: E731
    assert length(report) > length(untrained)  # training taught the head something (1.0 is the floor)
    assert (tmp_path / "mtp" / "token_counts.safetensors").is_file()  # what ranks its draft_vocab_size
    spec = SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False, model=str(tmp_path / "mtp"))
    eng = _engine(ours, spec, MTPDrafter.load(str(tmp_path / "mtp"), ours), max_num_seqs=32)
    prompts = [_repetitive(s) for s in range(8)]
    assert _greedy(eng, prompts, 24) == _greedy(_engine(ours, max_num_seqs=8), prompts, 24)
    assert eng.totals.accepted_tokens > 0
    assert sampled_joint_pvalue(eng, ours, [11, 12, 13, 14] * 5, 1000) > 0.001


def test_mtp_without_mtp_tensors_fails_at_start_up(hybrid, tmp_path):
    from safetensors.torch import load_file, save_file

    from specserve.errors import SpecserveError

    dst, _ = _copy(hybrid, tmp_path)
    f = dst / "model.safetensors"
    save_file({k: v for k, v in load_file(str(f)).items() if not k.startswith("mtp.")}, str(f),
              metadata={"format": "pt"})
    with pytest.raises(SpecserveError, match="ships no MTP head"):
        MTPDrafter.load(None, load_model(str(dst), FP32))


# ---- Qwen3-Next: mixture-of-experts MLPs, interleaved DeltaNet projections ---------------------
@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"), mtp=True)


def test_qwen3_next_matches_transformers(qwen3_next):
    ours, hf = qwen3_next
    cfg = ours.config
    assert cfg.arch == "qwen3next" and cfg.moe.num_experts == 4 and cfg.moe.sparse(2) and not cfg.moe.sparse(3)
    ids = _prompt(3, 40)
    eng = _engine(ours)
    eng.add_request("a", ids, SamplingParams(max_tokens=1))
    eng.scheduler.admit()
    rows = eng.scheduler.schedule(drafting=False)
    batch = eng.runner.batch(rows)
    batch.logits_indices = torch.arange(len(ids))
    got = ours.model.forward(batch, eng.kv).logits
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (got - ref).abs().max() <= RTOL * ref.abs().max()
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False)[0, len(ids):]
    want = want.tolist()
    assert len(want) >= 8 and _greedy(_engine(ours), [ids], 32)[0][:len(want)] == want


def test_qwen3_next_speculation_and_chunking_are_lossless(qwen3_next):
    ours, _ = qwen3_next
    prompts = [_prompt(60 + s, 25 + 11 * s) for s in range(4)]
    plain = _greedy(_engine(ours, max_num_seqs=4), prompts, 24)
    truth = {tuple(p): out for p, out in zip(prompts, plain)}
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    eng = _engine(ours, spec, OracleDrafter(truth), max_num_seqs=4, max_num_batched_tokens=16, max_step_ms=0)
    assert _greedy(eng, prompts, 24) == plain
    assert eng.totals.accepted_tokens > 0 and eng.cache.idle()
    mtp = _engine(ours, SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False),
                  MTPDrafter.load(None, ours), max_num_seqs=4)  # the checkpoint's MoE MTP head
    assert _greedy(mtp, prompts, 24) == plain and mtp.totals.draft_tokens > 0


def test_qwen3_next_gguf_greedy_equals_llama_cpp():
    """llama.cpp's GGUF of a Qwen3-Next (experts merged into 3-D tensors, ssm_ba interleaved per
    key head, value heads in the grouped order): native llama-server's greedy tokens, all of them
    (32 per prompt, or up to its end-of-text token); and lossless under speculation."""
    ours = load_model(str(DATA / "tiny-qwen3next-f32.gguf"), FP32)
    assert ours.config.arch == "qwen3next" and ours.config.moe.num_experts == 4 and not ours.config.deltanet.v_tiled
    prompts, n = LLAMA_CPP["prompts"], LLAMA_CPP["tokens"]
    plain = [_greedy(_engine(ours), [p], n)[0] for p in prompts]
    ref = LLAMA_CPP["files"]["tiny-qwen3next-f32.gguf"]  # llama.cpp stops at the end-of-text token
    assert [g[:len(r)] for g, r in zip(plain, ref)] == ref and sum(map(len, ref)) >= 3 * n
    truth = {tuple(p): out for p, out in zip(prompts, plain)}
    eng = _engine(ours, SpeculativeConfig("ngram", num_speculative_tokens=4), OracleDrafter(truth), max_num_seqs=4)
    assert _greedy(eng, prompts, n) == plain


# ---- bad checkpoints -------------------------------------------------------------------------
def _copy(hybrid, tmp_path):
    src = hybrid[0].resolved.path
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst, json.loads((dst / "config.json").read_text())


def test_unknown_layer_type_fails_at_load(hybrid, tmp_path):
    dst, cfg = _copy(hybrid, tmp_path)
    cfg["layer_types"][1] = "mamba2"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="mamba2"):
        load_model(str(dst), FP32)


def test_missing_tensor_fails_at_load(hybrid, tmp_path):
    from safetensors.torch import load_file, save_file

    dst, _ = _copy(hybrid, tmp_path)
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["model.layers.2.linear_attn.conv1d.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.2.ssm_conv1d"):
        load_model(str(dst), FP32)
