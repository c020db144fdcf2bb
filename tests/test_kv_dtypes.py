"""Quantized / low-precision KV caches (--kv-cache-dtype).

Each dtype round-trips within its documented error, attention over a quantized cache equals the
fp32 kernel over the dequantized values bit for bit (so it keeps the fixed reduction order and
stays batch-invariant), bytes per token are exact, and greedy speculation stays lossless.
"""

from types import SimpleNamespace

import pytest
import torch

from specserve.engine.config import EngineConfig, kv_bytes_per_token
from specserve.errors import SpecserveError
from specserve.kernels import ops
from specserve.models.kv_cache import KV_DTYPES, KVCache, resolve_kv_dtype

needs_c = pytest.mark.skipif(not ops.kernels_available(), reason="C kernels unavailable")


def _cfg(layers=2, hkv=2, d=64):
    # the ModelConfig fields the cache reads (no sliding-window or linear-attention layers)
    return SimpleNamespace(num_layers=layers, num_kv_heads=hkv, head_dim=d, is_linear=lambda i: False,
                           sliding=lambda i: False, attention_layers=tuple(range(layers)))


def _bound(dtype: str, x: torch.Tensor) -> torch.Tensor:
    """The documented worst-case |error| of each stored value of x [N, Hkv, D]."""
    a = x.abs()
    if dtype == "fp32":
        return torch.zeros_like(x)
    if dtype == "bf16":
        return a * 2.0 ** -8
    if dtype == "fp16":
        return a * 2.0 ** -11 + 2.0 ** -25
    amax = a.amax(-1, keepdim=True)
    if dtype == "int8":  # half a step of absmax / 127
        return (amax / 127 * 0.5001).expand_as(x)
    if dtype == "fp8_e4m3":  # 3 mantissa bits: half an ulp, and subnormal steps of scale * 2^-9
        return a * 2.0 ** -4 + amax / 448 * 2.0 ** -10 * 1.001
    # int4: half a step of (max - min) / 15 per group of 32
    g = x.reshape(*x.shape[:-1], -1, 32)
    step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
    return (step * 0.5001 + 1e-6 * g.abs().amax(-1, keepdim=True)).expand_as(g).reshape(x.shape)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_round_trip_within_documented_error(dtype):
    g = torch.Generator().manual_seed(1)
    cfg = _cfg(layers=2, hkv=3, d=64)
    kv = KVCache.allocate(cfg, 6, 8, dtype, "cpu")
    n = 40
    slots = torch.randperm(48, generator=g)[:n]
    # heavy-tailed values with per-channel offsets, like real keys
    k = torch.randn(n, 3, 64, generator=g) * torch.rand(1, 1, 64, generator=g) * 4 + torch.randn(1, 1, 64, generator=g)
    v = torch.randn(n, 3, 64, generator=g)
    v[0, 0, 5] = 30.0  # an outlier
    kv.write(1, slots, k, v)
    k2, v2 = kv.read(1, slots)
    for x, y in ((k, k2), (v, v2)):
        err = (x - y).abs()
        assert bool((err <= _bound(dtype, x)).all()), (dtype, float((err - _bound(dtype, x)).max()))
    if dtype == "fp32":
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # the other layer is untouched
    assert all(not t.any() for t in (kv.k[0], kv.v[0]))


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "int4"])
def test_constant_and_zero_rows(dtype):
    kv = KVCache.allocate(_cfg(1, 1, 64), 1, 4, dtype, "cpu")
    x = torch.stack([torch.zeros(1, 64), torch.full((1, 64), 0.75)])
    kv.write(0, torch.tensor([0, 1]), x, -x)
    k, v = kv.read(0, torch.tensor([0, 1]))
    assert torch.equal(k, x) and torch.equal(v, -x)


def _quant_case(dtype, D=64, Hq=6, Hkv=2, BS=8, lengths=(37, 70), seed=0):
    """A scattered two-sequence paged cache in dtype, with one query per position."""
    g = torch.Generator().manual_seed(seed)
    nbs = [(L + BS - 1) // BS for L in lengths]
    NB = sum(nbs) + 3
    perm = torch.randperm(NB, generator=g).to(torch.int32)
    bt = torch.full((len(lengths), max(nbs) + 1), -1, dtype=torch.int32)
    o = 0
    for s, nb in enumerate(nbs):
        bt[s, :nb] = perm[o:o + nb]
        o += nb
    kv = KVCache.allocate(_cfg(1, Hkv, D), NB, BS, dtype, "cpu")
    slots = torch.arange(NB * BS)
    kv.write(0, slots, torch.randn(NB * BS, Hkv, D, generator=g) * 2, torch.randn(NB * BS, Hkv, D, generator=g))
    sid = torch.cat([torch.full((L,), s, dtype=torch.int32) for s, L in enumerate(lengths)])
    pos = torch.cat([torch.arange(L, dtype=torch.int32) for L in lengths])
    q = torch.randn(len(sid), Hq, D, generator=g)
    return q, kv, bt, sid, pos


def _attn(q, kv, bt, sid, pos, impl, window=0, cap=0.0):
    k, v, extra = kv.attention_args(0)
    return ops.paged_attention(q, k, v, bt, sid, pos, q.shape[-1] ** -0.5, window, cap, impl=impl, **extra)


@needs_c
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("window,cap", [(0, 0.0), (9, 20.0), (100, 0.0)])
def test_attention_equals_fp32_kernel_on_dequantized_cache(dtype, window, cap):
    # window 100 over 230 positions: rows past the window start their keys at different places,
    # so the keys all rows of a work item share begin off a multiple of 8 and cross the
    # quantized kernel's 64-key tiles there (it read and wrote past its buffers before)
    q, kv, bt, sid, pos = _quant_case(dtype, lengths=(37, 230) if window == 100 else (37, 70))
    out = _attn(q, kv, bt, sid, pos, "c", window, cap)
    NB, BS = kv.k[0].shape[:2]
    kd, vd = kv.read(0, torch.arange(NB * BS))
    ref = ops.paged_attention(q, kd.reshape(NB, BS, *kd.shape[1:]).contiguous(),
                              vd.reshape(NB, BS, *vd.shape[1:]).contiguous(), bt, sid, pos,
                              q.shape[-1] ** -0.5, window, cap, impl="c")
    assert torch.equal(out, ref)
    fallback = _attn(q, kv, bt, sid, pos, "torch", window, cap)
    assert (fallback - out).abs().max() < 1e-5


@needs_c
@pytest.mark.parametrize("seed", range(6))
def test_attention_random_shapes(seed):
    """Random caches, windows and row sets (runs of consecutive rows, as verification and prefill
    chunks give, mixed with single rows of other sequences): each row's output equals the fp32
    kernel on the dequantized cache and the row computed alone, bit for bit, and the torch path
    within float error."""
    g = torch.Generator().manual_seed(100 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    for _ in range(8):
        dtype, D = pick(KV_DTYPES), pick([32, 64, 96, 128])
        Hkv, group, BS = pick([1, 2, 3]), pick([1, 2, 3, 5]), pick([4, 8, 16])
        lengths = tuple(int(x) for x in torch.randint(1, 300, (pick([1, 2, 3]),), generator=g))
        window, cap = pick([0, 0, 7, 64, 100, 129]), pick([0.0, 20.0])
        q, kv, bt, sid, pos = _quant_case(dtype, D=D, Hq=Hkv * group, Hkv=Hkv, BS=BS, lengths=lengths,
                                          seed=int(torch.randint(1 << 30, (1,), generator=g)))
        rows = torch.randperm(len(sid), generator=g)[:6].tolist()  # single rows
        start = sum(lengths[:-1])
        n = min(lengths[-1], pick([2, 4, 5, 8, 16]))
        run = list(range(start + lengths[-1] - n, start + lengths[-1]))  # the last n of the last sequence
        idx = torch.tensor(rows + run)
        args = (q[idx].contiguous(), kv, bt, sid[idx].contiguous(), pos[idx].contiguous())
        out = _attn(*args, "c", window, cap)
        case = (dtype, D, Hkv, group, BS, lengths, window, cap)
        NB = kv.k[0].shape[0]
        kd, vd = kv.read(0, torch.arange(NB * BS))
        ref = ops.paged_attention(args[0], kd.reshape(NB, BS, *kd.shape[1:]).contiguous(),
                                  vd.reshape(NB, BS, *vd.shape[1:]).contiguous(), bt, args[3], args[4],
                                  D ** -0.5, window, cap, impl="c")
        assert torch.equal(out, ref), case
        assert (_attn(*args, "torch", window, cap) - out).abs().max() < 1e-4, case
        for t in range(len(idx)):
            one = _attn(args[0][t:t + 1], kv, bt, args[3][t:t + 1], args[4][t:t + 1], "c", window, cap)
            assert torch.equal(one[0], out[t]), (case, t)


@needs_c
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("Hkv,group,D", [(1, 4, 256), (1, 3, 100), (2, 2, 64)])
def test_decode_rows_shared_by_threads(dtype, Hkv, group, D):
    """A decode row with fewer kv heads than threads is shared by the threads phase by phase
    (scores by key chunks, V sums by head-dim parts): the same bits as on one thread, and as the
    same row in a batch (whose work items each go to one thread)."""
    q, kv, bt, sid, pos = _quant_case(dtype, D=D, Hq=Hkv * group, Hkv=Hkv, BS=16, lengths=(700, 333), seed=9)
    rows = [699, 650, 300, 700 + 332, 700 + 3]  # long contexts (shared), and a short one (4 keys: one thread)
    nt = ops.get_num_threads()
    try:
        for window in (0, 300):
            ops.set_num_threads(1)
            ref = _attn(q, kv, bt, sid, pos, "c", window)
            for threads in (2, 3, 4):
                ops.set_num_threads(threads)
                for t in rows:
                    one = _attn(q[t:t + 1].contiguous(), kv, bt, sid[t:t + 1].contiguous(), pos[t:t + 1].contiguous(),
                                "c", window)
                    assert torch.equal(one[0], ref[t]), (window, threads, t)
            ops.set_num_threads(2)
            for variant in ("c-avx2", "c-scalar"):  # the builds with SIMD paths compiled out
                try:
                    ops._select(variant)
                except ops.KernelError:  # e.g. a non-x86 host for c-avx2
                    continue
                one = _attn(q[699:700].contiguous(), kv, bt, sid[699:700].contiguous(), pos[699:700].contiguous(),
                            variant, window)
                assert torch.equal(one[0], ref[699]), (variant, window)
    finally:
        ops.set_num_threads(nt)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_attention_close_to_fp32_cache(dtype):
    """Attention output error vs the same values kept in fp32 (loose, per-dtype tolerance)."""
    q, kv32, bt, sid, pos = _quant_case("fp32", seed=3)
    kvq = KVCache.allocate(_cfg(1, 2, 64), kv32.k[0].shape[0], kv32.k[0].shape[1], dtype, "cpu")
    slots = torch.arange(kv32.k[0].shape[0] * kv32.k[0].shape[1])
    kvq.write(0, slots, *kv32.read(0, slots))
    impl = "c" if ops.kernels_available() else "torch"
    a = _attn(q, kv32, bt, sid, pos, impl)
    b = _attn(q, kvq, bt, sid, pos, impl)
    # (max, mean) |error|; measured: bf16 0.011/0.001, fp16 0.0013/0.00013, int8 0.030/0.0037,
    # fp8_e4m3 0.16/0.014, int4 0.49/0.050 (outputs are O(1))
    tol_max, tol_mean = {"fp32": (0.0, 0.0), "bf16": (0.02, 0.002), "fp16": (0.003, 0.0003),
                         "int8": (0.06, 0.008), "fp8_e4m3": (0.3, 0.03), "int4": (0.8, 0.1)}[dtype]
    err = (a - b).abs()
    assert float(err.max()) <= tol_max and float(err.mean()) <= tol_mean, (dtype, float(err.max()), float(err.mean()))


@needs_c
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_attention_batch_invariant(dtype):
    """A query's result is bit-identical alone, in any subset, or in the whole batch."""
    q, kv, bt, sid, pos = _quant_case(dtype, D=64, Hq=4, Hkv=2, seed=5)
    full = _attn(q, kv, bt, sid, pos, "c")
    g = torch.Generator().manual_seed(0)
    for t in torch.randperm(q.shape[0], generator=g)[:12].tolist():
        one = _attn(q[t:t + 1].contiguous(), kv, bt, sid[t:t + 1].contiguous(), pos[t:t + 1].contiguous(), "c")
        assert torch.equal(one[0], full[t]), (dtype, t)
    idx = torch.tensor([3, 50, 90, 7])
    part = _attn(q[idx].contiguous(), kv, bt, sid[idx].contiguous(), pos[idx].contiguous(), "c")
    assert torch.equal(part, full[idx])
    nt = ops.get_num_threads()
    try:
        ops.set_num_threads(1)
        assert torch.equal(_attn(q, kv, bt, sid, pos, "c"), full)
    finally:
        ops.set_num_threads(nt)


@needs_c
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("variant", ["c-avx2", "c-scalar"])
def test_quantized_attention_other_builds_bit_identical(dtype, variant):
    try:
        ops._select(variant)
    except ops.KernelError as e:
        pytest.skip(str(e))
    q, kv, bt, sid, pos = _quant_case(dtype, D=96, Hq=4, Hkv=2, seed=2, lengths=(37, 230))
    for window in (0, 100):
        assert torch.equal(_attn(q, kv, bt, sid, pos, "c", window), _attn(q, kv, bt, sid, pos, variant, window))


def _quantize_inputs(D: int) -> list[torch.Tensor]:
    """Rows that reach every rounding case: normal values over 70 decades, ties (multiples of 1/8),
    zeros and constant groups, and random finite bit patterns (subnormals included)."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(-2**31, 2**31 - 1, (1500, D), generator=g, dtype=torch.int64).to(torch.int32)
    bits = bits.view(torch.float32)
    zeros = torch.randn(60, D, generator=g)
    zeros[:, ::3] = 0
    zeros[:10] = 0
    zeros[10:20] = 2.5
    # exact ties after the scale: int8 rows with max |x| = 127 (scale 1) and halves; int4 groups
    # spanning [0, 15] (scale 1, min 0) and halves; fp8 rows with max 448 and midpoints of codes
    i8 = (torch.randint(-253, 254, (100, D), generator=g) / 2).float()
    i8[:, 0] = 127
    i4 = torch.randint(0, 30, (100, D), generator=g).float() / 2
    i4[:, 0::16], i4[:, 1::16] = 0, 15
    codes = torch.arange(0, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[:-1] + codes[1:]) / 2
    signs = torch.where(torch.rand(100, D, generator=g) < 0.5, -1, 1)
    f8 = mids[torch.randint(0, mids.numel(), (100, D), generator=g)] * signs
    f8[:, 0] = 448
    return [torch.randn(400, D, generator=g) * torch.logspace(-40, 30, 400).unsqueeze(1), i8, i4, f8,
            torch.randint(-2000, 2000, (400, D), generator=g).float() / 8, zeros,
            torch.where(torch.isfinite(bits), bits, torch.zeros_like(bits))]


@needs_c
@pytest.mark.parametrize("impl", ["c", "c-avx2", "c-scalar"])
def test_c_quantizer_writes_the_bits_of_kv_quantize(impl):
    """The fused decoder path quantizes K/V rows in C; every build gives kv_quantize's bytes and
    scales (torch: the Python path's KVCache.write)."""
    try:
        ops._select(impl)
    except ops.KernelError as e:
        pytest.skip(str(e))
    for D in (64, 48):
        for x in _quantize_inputs(D):
            for dtype in KV_DTYPES:
                xx = x.clamp(-65000, 65000) if dtype == "fp16" else x  # beyond: inf either way
                data, scales = ops.kv_quantize(xx, dtype)
                c_data, c_scales = ops.kv_quantize_c(xx, dtype, impl)
                assert torch.equal(data.view(torch.uint8), c_data.view(torch.uint8)), (impl, D, dtype)
                assert (scales is None and c_scales is None) or torch.equal(scales, c_scales), (impl, D, dtype)
    x, out, sc = torch.zeros(1, 6), torch.zeros(3, dtype=torch.uint8), torch.zeros(4)
    lib = ops._select(impl)  # int4 groups must be even and divide D
    assert lib.ss_kv_quantize(ops.KV_FORMATS["int4"][0], x.data_ptr(), 1, 6, 4, out.data_ptr(), sc.data_ptr()) == -1
    assert lib.ss_kv_quantize(ops.KV_FORMATS["int4"][0], x.data_ptr(), 1, 6, 3, out.data_ptr(), sc.data_ptr()) == -1


def test_fp8_decode_table_matches_torch():
    if not ops.kernels_available():
        pytest.skip("C kernels unavailable")
    lib = ops._get_lib()
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mine = torch.tensor([lib.ss_fp8_e4m3_to_float(i) for i in range(256)])
    assert torch.equal(ref.nan_to_num(7.0), mine.nan_to_num(7.0))


@needs_c
def test_fp8_simd_decode_exhaustive():
    """Every fp8 byte (in 8-wide SIMD chunks and scalar tails) dequantizes to torch's value * scale."""
    D = 264  # 33 chunks of 8: all 256 codes in SIMD lanes, plus tails
    codes = torch.cat([torch.arange(256), torch.arange(8)]).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # no NaN codes (never written)
    D = codes.numel() - codes.numel() % 2
    data = codes[:D].view(1, 1, 1, D).contiguous()
    scales = torch.full((1, 1, 1), 0.37)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    # one key: softmax weight 1, so the output is exactly the dequantized V row
    q = torch.zeros(1, 1, D)
    out = ops.paged_attention(q, data, data, bt, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                              1.0, kv_dtype="fp8_e4m3", k_scales=scales, v_scales=scales, impl="c")
    ref = ops.kv_dequantize(data, scales, "fp8_e4m3")
    assert torch.equal(out.view(-1), ref.view(-1))


def test_quantized_attention_argument_checks():
    q, kv, bt, sid, pos = _quant_case("int8")
    k, v, extra = kv.attention_args(0)
    with pytest.raises(ValueError, match="k_scales"):
        ops.paged_attention(q, k, v, bt, sid, pos, 0.1, kv_dtype="int8")
    with pytest.raises(ValueError, match="int8"):
        ops.paged_attention(q, k.float(), v.float(), bt, sid, pos, 0.1, **extra)
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        ops.paged_attention(q, k, v, bt, sid, pos, 0.1, kv_dtype="int3")


# ---- bytes per token ------------------------------------------------------------------------

SMOLLM2 = _cfg(layers=30, hkv=3, d=64)


@pytest.mark.parametrize("dtype,expected", [
    ("fp32", 2 * 30 * 3 * 64 * 4),
    ("bf16", 2 * 30 * 3 * 64 * 2),
    ("fp16", 2 * 30 * 3 * 64 * 2),
    ("fp8_e4m3", 2 * 30 * 3 * (64 + 4)),
    ("int8", 2 * 30 * 3 * (64 + 4)),
    ("int4", 2 * 30 * 3 * (32 + 2 * 8)),
])
def test_bytes_per_token_exact(dtype, expected):
    assert kv_bytes_per_token(SMOLLM2, dtype) == expected
    # and equal to what the allocated pools really take
    kv = KVCache.allocate(_cfg(3, 2, 128), 5, 16, dtype, "cpu")
    assert kv.nbytes() == 5 * 16 * kv_bytes_per_token(_cfg(3, 2, 128), dtype)


def test_torch_dtypes_still_accepted():
    assert kv_bytes_per_token(SMOLLM2, torch.float32) == kv_bytes_per_token(SMOLLM2, "fp32")
    kv = KVCache.allocate(_cfg(), 2, 4, torch.float32, torch.device("cpu"))
    assert kv.kv_dtype == "fp32" and kv.k[0].dtype == torch.float32
    assert resolve_kv_dtype("auto", "cpu") == "fp32"
    assert resolve_kv_dtype("auto", "cuda", torch.bfloat16) == "bf16"


def test_engine_config_accepts_dtypes():
    for d in ("auto", *KV_DTYPES):
        EngineConfig(kv_cache_dtype=d)
    with pytest.raises(SpecserveError, match="kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="int3")


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "int4"])
def test_quantized_kv_on_cuda_is_a_clear_error(dtype):
    with pytest.raises(SpecserveError, match="not supported on CUDA"):
        KVCache.allocate(_cfg(), 2, 4, dtype, torch.device("cuda"))


# ---- the engine -----------------------------------------------------------------------------

SPEC = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_speculation_lossless_with_quantized_kv(dtype):
    from engine_utils import bench_prompts, chat_ids, make_engine, run_all
    from specserve.engine.types import SamplingParams

    params = SamplingParams(max_tokens=48, ignore_eos=True)
    common = ("--model", "smollm2-135m", "--max-num-seqs", "4", "--max-model-len", "1024",
              "--kv-cache-dtype", dtype)
    plain = make_engine(*common)
    assert plain.kv.kv_dtype == dtype and plain.kv.k[0].dtype == ops.KV_FORMATS[dtype][1]
    prompts = [chat_ids(plain, t) for t in bench_prompts(1)] + [chat_ids(plain, "Repeat: a b c a b c a b c")]
    want = run_all(plain, prompts, params)
    del plain
    spec = make_engine(*common, "--speculative-config", SPEC)
    got = run_all(spec, prompts, params)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a == b, f"prompt {i}: first difference at {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
    assert spec.totals.accepted_tokens > 0
    assert spec.blocks.num_free == spec.blocks.num_blocks
