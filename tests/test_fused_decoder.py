"""The fused CPU decoder path (models/fused.py: all layers in one C call) against the per-op Python
path, bit for bit: every tiny family, decode / batch / verify shapes, window pools, mixed weight
formats, quantized KV caches, hidden states, the fallback, every kernel build; and the engine's
paging of sliding-window layers apart, in a fixed pool."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from equivalence_utils import FP32, PagedSeq, paged_batch, random_prompt, run_ours, torch_threads  # noqa: E402
from specserve.engine.block_manager import HOLE  # noqa: E402
from specserve.engine.config import EngineConfig, kv_bytes_per_token  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.errors import ModelLoadError  # noqa: E402
from specserve.speculative.config import parse_speculative_config  # noqa: E402
from specserve.speculative.registry import build_drafter  # noqa: E402
from specserve.models.catalog import resolve_model  # noqa: E402
from specserve.models.layers import linears  # noqa: E402
from specserve.models.loader import LoadedModel, LoadOptions, load_model  # noqa: E402
from specserve.models.transformer import ForwardBatch, KVCache  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One thread: small ops, where 2 threads' OpenMP workers spin on each other; results do not
    depend on the thread count."""
    with torch_threads(1):
        yield


# ---------------------------------------------------------------------------------------------
# the engine pages sliding-window layers apart, in a fixed pool
# ---------------------------------------------------------------------------------------------

def _window_engine(lm: LoadedModel, spec: str | None = None, **kw):
    ecfg = EngineConfig(block_size=4, max_model_len=256, max_num_seqs=2, **kw)
    spec_cfg = parse_speculative_config(spec)
    return LLMEngine(lm, ecfg, spec_cfg, build_drafter(spec_cfg, lm, FP32, ecfg, 256))


def _engine_greedy(engine, prompt: list[int], n: int, watch=None) -> list[int]:
    engine.add_request("w", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    got: list[int] = []
    while engine.has_work():
        for out in engine.step():
            got += out.new_token_ids
        if watch:
            watch(engine)
    return got


@pytest.mark.parametrize("spec", [None, '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'])
def test_sliding_window_layers_keep_only_their_window(spec, tiny_models):
    """tiny Gemma 3 (window 16, block 4): the engine keeps the sliding layers' last window only,
    in a pool of their own, and its tokens equal full paging (run_ours) bit for bit, with or
    without speculation and with prefill in chunks of 8."""
    lm, _ = tiny_models("gemma3")
    cfg = lm.config
    prompt = (random_prompt(20, 7) * 3)[:50]  # repeats: the n-gram drafter finds matches
    steps = 60
    _, want = run_ours(lm, prompt, steps, block_size=4)
    for kw in ({}, {"max_num_batched_tokens": 8}):
        engine = _window_engine(lm, spec, **kw)
        plan = engine.plan
        assert plan.sliding_window == 16 and plan.window_blocks > 0
        assert not engine.blocks.prefix_caching  # a cached prefix would lack its window: off
        assert plan.kv_bytes_per_token == kv_bytes_per_token(cfg, "fp32", cfg.num_global_layers)
        sliding = [i for i in range(cfg.num_layers) if cfg.sliding(i)]
        assert all(engine.kv.k[i].shape[0] == plan.window_blocks for i in sliding)
        assert engine.kv.nbytes() == plan.pool_bytes
        live: list[int] = []

        def watch(e):
            for seq in e.running:
                full, window = seq.cache.tables
                live.append(sum(b != HOLE for b in window.blocks))
                assert len(full.blocks) >= len(window.blocks)

        got = _engine_greedy(engine, prompt, steps + 1, watch)
        assert got == want, f"window paging differs from full paging ({kw}, spec={spec})"
        # the window (16 tokens = 4 blocks) plus partial blocks and one step's tokens, never the context
        assert live and max(live) <= 16 // 4 + 2
        wpool = engine.cache.managers[1].pool
        assert wpool.num_free == wpool.num_blocks and engine.cache.idle()
        assert engine.blocks.num_free == engine.blocks.num_blocks
        engine.blocks.check_invariants()
        wpool.check_invariants()
        if spec:
            assert engine.totals.accepted_tokens > 0


def test_window_paging_only_when_the_context_outgrows_the_window(tiny_models):
    lm, _ = tiny_models("gemma3")
    short = LLMEngine(lm, EngineConfig(block_size=4, max_model_len=16))
    assert short.plan.sliding_window == 0 and len(short.cache.managers) == 1 and short.blocks.prefix_caching
    assert short.plan.kv_bytes_per_token == kv_bytes_per_token(lm.config, "fp32")
    mistral, _ = tiny_models("mistral")  # every layer slides: nothing to page apart
    assert LLMEngine(mistral, EngineConfig(block_size=4, max_model_len=64)).plan.sliding_window == 0


# ---------------------------------------------------------------------------------------------
# the fused CPU decoder path (models/fused.py) is bit-identical to the per-op Python path
# ---------------------------------------------------------------------------------------------

# scenario -> forward passes, each a list of (sequence, new tokens): prefill first, then the shape
# under test (decode T=1 / several sequences one token each / one sequence several tokens)
FUSED_SCENARIOS = {
    "decode": [[(0, 20)], [(0, 1)], [(0, 1)], [(0, 1)]],
    "batch": [[(0, 9), (1, 14), (2, 5)], [(0, 1), (1, 1), (2, 1)], [(2, 1), (0, 1), (1, 1)]],
    "verify": [[(0, 30)], [(0, 5)], [(0, 3)]],
}


def _window_paging(batch: ForwardBatch, parts: list[tuple[PagedSeq, list[int]]]) -> ForwardBatch:
    """batch with the sliding layers' own block tables / slots (a second paging group: pools of
    their own, as the engine gives long contexts); parts: each row's window-pool sequence
    (advanced here)."""
    batch.paging = (*batch.paging, *paged_batch(parts).paging)
    return batch


def _run_path(model, cfg, scenario: str, fused: bool, hidden_layers=(), kv_dtype="fp32", expect_fused=None,
              window_pool=False):
    """All passes of a scenario on a fresh cache; returns (outputs, cache)."""
    model.fused = fused
    rng, bs = random.Random(7), 4
    kv = KVCache.allocate(cfg, 60, bs, kv_dtype, window_blocks=30 if window_pool else None)
    blocks = list(range(60))
    random.Random(3).shuffle(blocks)  # non-contiguous block tables
    seqs = [PagedSeq(blocks[i * 20:(i + 1) * 20], bs) for i in range(3)]
    wseqs = [PagedSeq(sorted(b for b in blocks if b < 30)[i::3], bs) for i in range(3)]  # the window pools
    vocab = min(cfg.vocab_size, 300)
    outs = []
    try:
        for parts in FUSED_SCENARIOS[scenario]:
            toks = [[rng.randrange(3, vocab) for _ in range(n)] for _, n in parts]
            batch = paged_batch([(seqs[j], t) for (j, _), t in zip(parts, toks)], hidden_layers)
            if window_pool:
                batch = _window_paging(batch, [(wseqs[j], t) for (j, _), t in zip(parts, toks)])
            if expect_fused is not None:
                assert (model.fused_stack(batch, kv) is not None) == expect_fused
            outs.append(model.forward(batch, kv))
    finally:
        model.fused = True
    return outs, kv


def _assert_fused_equals_python(model, cfg, scenario: str, hidden_layers=(), kv_dtype="fp32", fused_runs=True,
                                window_pool=False):
    fused, kv_f = _run_path(model, cfg, scenario, True, hidden_layers, kv_dtype, fused_runs, window_pool)
    python, kv_p = _run_path(model, cfg, scenario, False, hidden_layers, kv_dtype, False, window_pool)
    for i, (a, b) in enumerate(zip(fused, python)):
        assert torch.equal(a.logits, b.logits), f"{scenario} pass {i}: logits differ"
        assert torch.equal(a.final_hidden, b.final_hidden), f"{scenario} pass {i}: final hidden differs"
        assert a.hidden.keys() == b.hidden.keys() == set(hidden_layers)
        for layer in hidden_layers:
            assert torch.equal(a.hidden[layer], b.hidden[layer]), f"{scenario} pass {i}: hidden[{layer}] differs"
    pools = [(kv_f.k, kv_p.k), (kv_f.v, kv_p.v)]
    pools += [(kv_f.k_scales, kv_p.k_scales), (kv_f.v_scales, kv_p.v_scales)] if kv_f.k_scales else []
    for fa, pa in pools:
        assert all(torch.equal(x, y) for x, y in zip(fa, pa)), f"{scenario}: KV caches differ"


@pytest.mark.parametrize("scenario", list(FUSED_SCENARIOS))
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen2_sliding", "gemma3"])
def test_fused_layers_equal_python_tiny(kind, scenario, tiny_models):
    """Llama, Qwen2 (q/k/v biases), Qwen3 (qk-norm), sliding layers sharing the block tables, Gemma 3
    (sandwich norms, the sliding layers' own rope base, gelu)."""
    lm, _ = tiny_models(kind)
    _assert_fused_equals_python(lm.model, lm.config, scenario)


@pytest.mark.parametrize("kind", ["mistral", "qwen2_sliding", "gemma3"])
def test_fused_layers_equal_python_window_pools(kind, tiny_models):
    """Sliding layers with pools and block tables of their own (a second paging group)."""
    lm, _ = tiny_models(kind)
    for scenario in FUSED_SCENARIOS:
        _assert_fused_equals_python(lm.model, lm.config, scenario, window_pool=True)


def _split_linear(lin, sizes: list[int], weights) -> list:
    """Separate Linear objects for the row blocks of a fused one, each in its own weight format."""
    from specserve.models.layers import Linear

    full = lin.weight.dequantize()  # [sum(sizes), K]
    out, start = [], 0
    for n, make in zip(sizes, weights):
        weight = make(full[start:start + n].contiguous())
        bias = None if lin.bias is None else lin.bias[start:start + n].contiguous()
        out.append(Linear.of_weight(weight, bias, lin.device, type(weight).__name__))
        start += n
    return out


def test_fused_layers_separate_projections_in_mixed_formats(tiny_models):
    """Layers whose q / k / v (gate / up) are separate weights in different formats (as GGUF files with
    a different quant for v on some layers) still run fused, and exactly like the Python path."""
    import copy

    from specserve.kernels import ops

    lm, _ = tiny_models("qwen2")
    model, cfg = copy.deepcopy(lm.model), lm.config
    formats = [ops.Int8Weight.from_float, ops.F32Weight.from_float,
               lambda w: ops.GGUFBlockWeight.from_float(w, "Q8_0")]
    for i in (0, 2):
        layer = model.layers[i]
        layer.q, layer.k, layer.v = _split_linear(layer.qkv, [cfg.q_size, cfg.kv_size, cfg.kv_size],
                                                  formats if i == 0 else formats[::-1])
        layer.qkv = None
    layer = model.layers[1]
    mlp = model.layers[1].mlp
    mlp.gate, mlp.up = _split_linear(mlp.gate_up, [cfg.intermediate_size] * 2, formats[1:])
    mlp.gate_up = None
    for scenario in FUSED_SCENARIOS:
        _assert_fused_equals_python(model, cfg, scenario)


def test_fused_layers_hidden_states(tiny_models):
    """Drafters' hidden_layers: the stack runs in segments; hidden / final_hidden are exact."""
    lm, _ = tiny_models("qwen3")
    for scenario in ("batch", "verify"):
        _assert_fused_equals_python(lm.model, lm.config, scenario, hidden_layers=(0, 2))
        _assert_fused_equals_python(lm.model, lm.config, scenario, hidden_layers=(1,))


def test_fused_layers_fall_back(tiny_models):
    """Unsupported configurations take the Python path and still give its results: the torch kernels."""
    from specserve.kernels import ops
    from specserve.models.fused import unsupported

    qwen, _ = tiny_models("qwen2")
    assert unsupported(qwen.model) is None
    ops.set_default_impl("torch")
    try:
        outs, _ = _run_path(qwen.model, qwen.config, "decode", True, expect_fused=False)
    finally:
        ops.set_default_impl(None)
    ref, _ = _run_path(qwen.model, qwen.config, "decode", True, expect_fused=True)
    for a, b in zip(outs, ref):  # torch's silu / rope vs the C kernels: not bit-identical, close
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8_e4m3", "int8", "int4"])
def test_fused_layers_equal_python_quantized_kv(kv_dtype, tiny_models):
    """Every KV cache dtype runs fused: the C code writes the bits of KVCache.write (torch's
    kv_quantize) and attends over them as the Python path does."""
    for kind in ("llama", "qwen3"):
        lm, _ = tiny_models(kind)
        for scenario in FUSED_SCENARIOS:
            _assert_fused_equals_python(lm.model, lm.config, scenario, kv_dtype=kv_dtype)
    lm, _ = tiny_models("mistral")
    _assert_fused_equals_python(lm.model, lm.config, "batch", kv_dtype=kv_dtype, window_pool=True)


@pytest.mark.parametrize("quant", ["none", "q4"])
def test_fused_layers_equal_python_smollm2(smollm2_quantized, quant):
    lm = smollm2_quantized(quant)
    for scenario in FUSED_SCENARIOS:
        _assert_fused_equals_python(lm.model, lm.config, scenario)
    _assert_fused_equals_python(lm.model, lm.config, "verify", kv_dtype="int8")
    if quant == "q4":  # switching the weights to fp32 activations at run time reaches the fused path
        weights = [lin.weight for layer in lm.model.layers for lin in linears(layer)]
        try:
            for w in weights:
                w.int_dot = False
            _assert_fused_equals_python(lm.model, lm.config, "verify")
            fp32_act = _run_path(lm.model, lm.config, "decode", True)[0]
        finally:
            for w in weights:
                w.int_dot = True
        assert not torch.equal(fp32_act[-1].logits, _run_path(lm.model, lm.config, "decode", True)[0][-1].logits)


def test_fused_layers_equal_python_qwen_mixed_formats():
    """qwen2.5-coder-0.5b's GGUF keeps v (and down) in other formats on some layers: those layers
    have separate q / k / v weights. Skipped unless the model is cached (no download)."""
    try:
        resolve_model("qwen2.5-coder-0.5b", fetch=False)
    except ModelLoadError:
        pytest.skip("qwen2.5-coder-0.5b is not cached")
    lm = load_model("qwen2.5-coder-0.5b", LoadOptions(device="cpu", dtype="float32", quantization="q4"))
    assert any(layer.qkv is None for layer in lm.model.layers)
    for scenario in ("decode", "verify"):
        _assert_fused_equals_python(lm.model, lm.config, scenario)


@pytest.mark.parametrize("variant", ["c-avx2", "c-scalar"])
def test_fused_layers_same_bits_in_every_build(variant, tiny_models):
    """The AVX-512 (native), AVX2 and scalar builds of the fused path give the same bits."""
    from specserve.kernels import ops

    try:
        ops._select(variant)
    except ops.KernelError as e:
        pytest.skip(str(e))
    lm, _ = tiny_models("qwen3")
    native, _ = _run_path(lm.model, lm.config, "batch", True, expect_fused=True)
    ops.set_default_impl(variant)
    try:
        other, _ = _run_path(lm.model, lm.config, "batch", True, expect_fused=True)
        _assert_fused_equals_python(lm.model, lm.config, "verify")
    finally:
        ops.set_default_impl(None)
    for a, b in zip(native, other):
        assert torch.equal(a.logits, b.logits)


def test_the_stage_timers_add_time_only_while_on_and_move_no_bits(tiny_models):
    """library.decoder_profile: with the timers on, a fused forward adds time to every stage of its
    layers (each stage runs in every layer) and gives the same bits as with them off; switched off,
    nothing is added."""
    from specserve.kernels import library

    if not library.kernels_available():
        pytest.skip("no C compiler")
    lm, _ = tiny_models("qwen2")
    try:
        off, _ = _run_path(lm.model, lm.config, "verify", True, expect_fused=True)
        assert set(library.decoder_profile(True)) == set(library.DECODER_STAGES)
        on, _ = _run_path(lm.model, lm.config, "verify", True, expect_fused=True)
        spent = library.decoder_profile(False)
        assert all(spent[s] > 0 for s in library.DECODER_STAGES), spent
        _run_path(lm.model, lm.config, "verify", True, expect_fused=True)
        assert not any(library.decoder_profile().values())
    finally:
        library.decoder_profile(False)
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(off, on))
