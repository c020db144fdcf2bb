"""Tests of the batch-invariant CPU kernels (specserve.kernels.ops).

Invariance is checked bit for bit (torch.equal): a row computed in a call of
M rows must equal the same row computed alone, for any M, any grouping of
queries and any thread count. Correctness is checked against float64
references; GGUF dequantization against gguf-py's reference dequantizer.

Linear layers with int8 / GGUF weights quantize the activations to int8 by
default (the integer-dot path): their float64 reference multiplies the
weights with the activations quantized by an independent numpy quantizer,
so a wrong integer sum or block scale still fails at 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.kernels import build, ops

HAVE_C = ops.kernels_available()
needs_c = pytest.mark.skipif(not HAVE_C, reason="C kernels unavailable (no compiler?)")

ROW_COUNTS = (1, 2, 3, 7, 8, 9, 12, 16, 17, 64)
IMPLS = [pytest.param("c", marks=needs_c), "torch"]


@pytest.fixture(autouse=True)
def _one_thread_by_default():
    """Tests run single-threaded unless they compare thread counts: the
    per-row torch fallback issues many tiny ops, and on an oversubscribed
    machine every OpenMP barrier can wait a whole scheduler slice."""
    n = torch.get_num_threads()
    _set_threads(1)
    yield
    torch.set_num_threads(n)
    ops.set_num_threads(None)


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    ops.set_num_threads(n)


# --------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------

_rng = np.random.default_rng(1234)


def random_kquant(qtype: str, n: int, k: int) -> ops.GGUFBlockWeight:
    """Random Q4_K / Q6_K bytes with valid (finite, small) f16 scales.
    gguf-py has no quantizer for the K-quants."""
    _, be, bb = ops.GGUF_QTYPES[qtype]
    raw = _rng.integers(0, 256, size=(n, k // be, bb), dtype=np.uint8)
    d = (_rng.standard_normal((n, k // be)) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, k // be, 2)
    if qtype == "Q4_K":
        dmin = (np.abs(_rng.standard_normal((n, k // be))) * 1e-2).astype(np.float16)
        raw[..., 0:2] = d
        raw[..., 2:4] = dmin.view(np.uint8).reshape(n, k // be, 2)
    else:  # Q6_K: ql, qh, scales, d at the end
        raw[..., 208:210] = d
    return ops.GGUFBlockWeight.from_raw(torch.from_numpy(raw.reshape(n, -1)), qtype, n, k)


def make_weight(fmt: str, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    if fmt == "f32":
        return ops.F32Weight.from_float(w)
    if fmt == "int8":
        return ops.Int8Weight.from_float(w)
    if fmt in ("Q8_0", "Q4_0", "Q4_1"):
        return ops.GGUFBlockWeight.from_float(w, fmt)
    return random_kquant(fmt, n, k)


FORMATS = ["f32", "int8", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def _shape_for(fmt: str) -> tuple[int, int]:
    # N not a multiple of the 8-channel block; K a multiple of the block size
    return (203, 512) if fmt in ("Q4_K", "Q6_K") else (203, 576)


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_containers(fmt):
    n, k = _shape_for(fmt)
    w = make_weight(fmt, n, k)
    assert w.shape == (n, k)
    d = w.dequantize()
    assert d.dtype == torch.float32 and d.shape == (n, k)
    assert torch.isfinite(d).all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gguf_dequantize_matches_gguf_py(qtype, impl):
    import gguf

    n, k = (13, 768) if qtype in ("Q4_K", "Q6_K") else (13, 320)
    w = make_weight(qtype, n, k, seed=3)
    ref = gguf.quants.dequantize(w.raw.numpy(), gguf.GGMLQuantizationType[qtype]).reshape(n, k)
    got = w.dequantize(impl=impl).numpy()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("variant", ["c", "c-scalar"])
def test_load_time_dequantizer_matches_gguf_py(qtype, variant):
    """RawTensor.dequantize goes through the C dequantizer (Q5_0 / Q5_1 have no other C path):
    the same bits as gguf-py, for random blocks with every high bit and nibble pattern."""
    import gguf

    from specserve.models.weights import RawTensor

    n, k = (7, 512) if qtype in ("Q4_K", "Q5_K") else (7, 96)
    rng = np.random.default_rng(5)
    ref_w = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32),
                                 gguf.GGMLQuantizationType.Q8_0) if qtype == "Q8_0" else None
    be, bb = {"Q4_K": (256, 144), "Q5_K": (256, 176)}.get(qtype) or (32, {"Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[qtype])
    raw = rng.integers(0, 256, (n, k // be, bb), dtype=np.uint8) if ref_w is None else ref_w.reshape(n, k // be, bb)
    scales = (rng.standard_normal((n, k // be, 2)) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, k // be, 4)
    nscale = 4 if qtype in ("Q5_1", "Q4_K", "Q5_K") else 2  # d (and m / dmin) as finite fp16
    raw[..., :nscale] = scales[..., :nscale]
    raw = np.ascontiguousarray(raw.reshape(n, -1))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float32)
    ops.set_default_impl(variant)
    try:
        got = RawTensor("w", (n, k), qtype, raw).dequantize().numpy()
        direct = ops.dequantize_blocks(torch.from_numpy(raw), qtype, n, k)
    finally:
        ops.set_default_impl(None)
    assert direct is not None and np.array_equal(direct.numpy().view(np.uint32), want.view(np.uint32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_gguf_from_raw_layout_and_errors():
    import gguf

    x = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_1)
    # 1-D bytes (as read from a file) are accepted
    w = ops.GGUFBlockWeight.from_raw(torch.from_numpy(raw.reshape(-1).copy()), "q4_1", 4, 64)
    assert w.raw.shape == (4, 2 * 20)
    # nibble order: low nibbles are elements 0..15 of each block
    d = w.dequantize(impl="torch")
    assert torch.allclose(d, torch.from_numpy(x), atol=0.1)
    w2 = ops.GGUFBlockWeight.from_raw(raw, gguf.GGMLQuantizationType.Q4_1, 4, 64)
    assert torch.equal(w2.raw, w.raw)
    with pytest.raises(ValueError):
        ops.GGUFBlockWeight.from_raw(torch.from_numpy(raw.reshape(-1).copy()), "Q4_1", 4, 65)
    with pytest.raises(ValueError):
        ops.GGUFBlockWeight.from_raw(torch.from_numpy(raw.reshape(-1)[:-1].copy()), "Q4_1", 4, 64)
    with pytest.raises(ValueError):
        ops.GGUFBlockWeight.from_raw(torch.from_numpy(raw.reshape(-1).copy()), "Q5_1", 4, 64)


def test_int8_from_float():
    w = torch.randn(17, 40)
    w[3] = 0.0
    q = ops.Int8Weight.from_float(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (17,)
    assert int(q.q.abs().max()) == 127
    assert torch.allclose(q.dequantize(), w, atol=float(w.abs().max()) / 127)
    assert torch.equal(q.dequantize()[3], torch.zeros(40))


# --------------------------------------------------------------------------
# linear
# --------------------------------------------------------------------------


def np_quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference activation quantizer (the documented rule, written independently of ops):
    per block dx = max|x| / 127 in float32, q = round half to even (x * float32(1 / dx))."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // block, block)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(all="ignore"):
        d = np.where(amax >= np.float32(1e-30), amax / np.float32(127), np.float32(0)).astype(np.float32)
        d = np.where(np.isfinite(amax), d, np.float32(np.nan)).astype(np.float32)
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
        q = np.rint(np.where(np.isfinite(xb), xb, 0) * inv[..., None]).astype(np.int8)
    return q.reshape(m, k), d


def _ref_linear(x, w, bias=None):
    """float64 x @ W^T (+ bias); x quantized as the kernel does when w uses the integer-dot path."""
    if w.act_block is not None:
        q, d = np_quantize(x.numpy(), w.act_block)
        m, k = q.shape
        xq = q.astype(np.float64).reshape(m, -1, w.act_block) * d.astype(np.float64)[..., None]
        x = torch.from_numpy(xq.reshape(m, k))
    r = x.double() @ w.dequantize().double().T
    if bias is not None:
        r = r + bias.double()
    return r


@pytest.mark.parametrize("int_dot", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_linear_accuracy(fmt, impl, int_dot):
    n, k = _shape_for(fmt)
    w = make_weight(fmt, n, k, seed=1)
    if fmt != "f32":
        w.int_dot = int_dot
    assert (w.act_block is not None) == (fmt != "f32" and int_dot)
    x = torch.randn(11, k)
    bias = torch.randn(n)
    y = ops.linear(x, w, bias, impl=impl)
    ref = _ref_linear(x, w, bias)
    assert y.shape == (11, n) and y.dtype == torch.float32
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, float(err)


INT_DOT_FORMATS = ["int8", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def _odd_shape_for(fmt: str) -> tuple[int, int]:
    # an odd number of activation blocks (the half pair at the end of a row of 32-blocks)
    return (37, 768) if fmt in ("Q4_K", "Q6_K") else (37, 544)


@pytest.mark.parametrize("fmt", INT_DOT_FORMATS)
def test_int_dot_error_vs_fp32_activations(fmt):
    """What quantizing the activations costs: the error against fp32 activations, relative
    to the largest output, stays at the level of one rounding step per block (about 1/254
    of max |x| per value, averaging out over K)."""
    n, k = _shape_for(fmt)
    w = make_weight(fmt, n, k, seed=6)
    x = torch.randn(16, k)
    x[:, ::7] *= 8  # outliers: a block's scale follows its largest value
    exact = x.double() @ w.dequantize().double().T
    err = float((ops.linear(x, w, impl="torch").double() - exact).abs().max() / exact.abs().max())
    print(f"\n{fmt}: int8 activations, max error / max |y| = {err:.2e}")
    assert 1e-5 < err < 3e-2


@needs_c
@pytest.mark.parametrize("fmt", INT_DOT_FORMATS)
def test_int_dot_batch_and_thread_invariance(fmt):
    """Every row count 1..40 (all micro tile shapes and remainders), odd block counts, N not a
    multiple of the 8-channel block, several thread counts: each row equals its single-row call."""
    n, k = _odd_shape_for(fmt)
    w = make_weight(fmt, n, k, seed=7)
    assert w.act_block is not None
    bias = torch.randn(n)
    x = torch.randn(40, k) * torch.linspace(0.01, 10, 40)[:, None]
    _set_threads(1)
    single = torch.stack([ops.linear(x[i:i + 1], w, bias, impl="c")[0] for i in range(40)])
    ref = _ref_linear(x, w, bias)
    assert float((single.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    for threads in (1, 2, 3):
        _set_threads(threads)
        for m in range(1, 41):
            assert torch.equal(ops.linear(x[:m], w, bias, impl="c"), single[:m]), (fmt, threads, m)
        for start in (1, 3, 6):  # the same rows at other positions in the call
            assert torch.equal(ops.linear(x[start:start + 29], w, bias, impl="c"), single[start:start + 29])


@needs_c
def test_int_dot_large_m():
    """More rows than one 64-row super tile, with rows of very different magnitudes."""
    w = make_weight("Q4_1", 21, 576, seed=8)
    x = torch.randn(150, 576) * torch.logspace(-4, 4, 150)[:, None]
    _set_threads(2)
    y = ops.linear(x, w, impl="c")
    for i in (0, 63, 64, 65, 127, 128, 149):
        assert torch.equal(y[i], ops.linear(x[i:i + 1], w, impl="c")[0]), i
    ref = _ref_linear(x, w)
    rel = (y.double() - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)
    assert float(rel.max()) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_int_dot_nonfinite_and_zero_rows(impl):
    """A row with Inf / NaN gives NaN outputs (no garbage, no effect on other rows); an all-zero
    or tiny (< 1e-30) activation block contributes exactly nothing."""
    w = make_weight("Q4_1", 16, 64, seed=9)
    x = torch.randn(5, 64)
    x[1, 3] = float("inf")
    x[2, 40] = float("nan")
    x[3] = 0.0
    x[4, :32] = 1e-35
    y = ops.linear(x, w, impl=impl)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.equal(y[0], ops.linear(x[:1], w, impl=impl)[0])
    assert torch.equal(y[3], torch.zeros(16))
    tail = x[4:5].clone()
    tail[0, :32] = 0.0
    assert torch.equal(y[4], ops.linear(tail, w, impl=impl)[0])


def _quantizer_cases(k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10)
    x = torch.randn(9, k, generator=g) * torch.logspace(-3, 3, k)
    x[1] = 0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("-inf")
    x[4, :64] = 1e-35  # below the 1e-30 floor
    x[5, :32] = torch.arange(32) - 15.5  # exact halves after scaling: round half to even
    x[5, 31] = 127.0
    x[6] *= 1e-20
    return x


@pytest.mark.parametrize("block", [32, 256])
def test_quantize_activations_matches_reference(block):
    x = _quantizer_cases(512)
    q, d = ops.quantize_activations(x, block)
    rq, rd = np_quantize(x.numpy(), block)
    assert np.array_equal(q.numpy(), rq)
    assert np.array_equal(d.numpy(), rd, equal_nan=True)
    assert int(q.abs().max()) == 127
    finite = torch.isfinite(d) & (d > 0)  # blocks below the 1e-30 floor are zero by design
    xq = (q.float().reshape(9, -1, block) * d.unsqueeze(-1)).reshape(9, -1)
    err = (xq - x).abs().reshape(9, -1, block)[finite]
    amax = x.abs().reshape(9, -1, block).amax(-1)[finite]
    assert bool((err <= amax.unsqueeze(-1) / 254 * 1.0001).all())


@needs_c
@pytest.mark.parametrize("variant", ["c", "c-avx2", "c-scalar"])
def test_c_activation_quantizer_equals_torch(variant):
    """The kernels' own quantizer (every build) produces exactly quantize_activations' values."""
    try:
        lib = ops._select(variant)
    except ops.KernelError as e:
        pytest.skip(str(e))
    x = _quantizer_cases(512)
    for fmt, block in ((ops._FMT_Q4_1, 32), (ops._FMT_Q4_K, 256)):
        q = torch.empty(9, 512, dtype=torch.int8)
        d = torch.empty(9, 512 // block)
        assert lib.ss_quantize_act(fmt, x.data_ptr(), 9, 512, 512, q.data_ptr(), d.data_ptr()) == 0
        tq, td = ops.quantize_activations(x, block)
        assert torch.equal(q, tq)
        assert torch.equal(torch.isnan(d), torch.isnan(td)) and torch.equal(d.nan_to_num(), td.nan_to_num())


@needs_c
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_batch_and_thread_invariance(fmt):
    n, k = _shape_for(fmt)
    w = make_weight(fmt, n, k, seed=2)
    bias = torch.randn(n)
    x = torch.randn(max(ROW_COUNTS), k)
    _set_threads(2)
    single = [ops.linear(x[i:i + 1], w, bias, impl="c")[0] for i in range(x.shape[0])]
    for threads in (2, 1):
        _set_threads(threads)
        for m in ROW_COUNTS:
            y = ops.linear(x[:m], w, bias, impl="c")
            for i in range(m):
                assert torch.equal(y[i], single[i]), (fmt, threads, m, i)
    # a row in the middle of a large (prefill-like) call with other offsets
    _set_threads(2)
    y = ops.linear(x[5:], w, bias, impl="c")
    assert all(torch.equal(y[i], single[5 + i]) for i in range(y.shape[0]))


@needs_c
def test_linear_large_m_and_odd_shapes():
    # M beyond the 32-row super tile; K not a multiple of 16 (f32 / int8 tails)
    for n, k in [(45, 37), (9, 8), (70, 1000), (1, 3)]:
        wf = torch.randn(n, k)
        for w in (ops.F32Weight.from_float(wf), ops.Int8Weight.from_float(wf)):
            assert w.act_block is None  # K % 32 != 0 (or fp32): fp32 activations
            x = torch.randn(75, k)
            y = ops.linear(x, w, impl="c")
            ref = _ref_linear(x, w)
            assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
            for i in (0, 31, 32, 33, 74):
                assert torch.equal(y[i], ops.linear(x[i:i + 1], w, impl="c")[0])


@needs_c
@pytest.mark.parametrize("variant", ["c-avx2", "c-scalar", "c-novnni"])
def test_simd_and_scalar_builds_bit_identical(variant):
    """Every code path (AVX-512 / AVX2 / scalar, with and without VNNI) implements the same
    arithmetic, so results do not depend on the machine's ISA."""
    try:
        ops._select(variant)
    except ops.KernelError as e:  # e.g. a non-x86 host for c-avx2
        pytest.skip(str(e))
    for fmt in FORMATS:
        for shape in {_shape_for(fmt), _odd_shape_for(fmt)}:
            n, k = shape
            w = make_weight(fmt, n, k, seed=4)
            bias = torch.randn(n)
            for int_dot in (True, False):
                if fmt != "f32":
                    w.int_dot = int_dot
                for m in (1, 2, 5, 8, 9, 16, 40):
                    x = torch.randn(m, k)
                    a = ops.linear(x, w, bias, impl="c")
                    assert torch.equal(a, ops.linear(x, w, bias, impl=variant)), (fmt, shape, int_dot, m)
    q, kc, vc, bt, sid, pos = _attention_case(D=72, Hq=4, Hkv=2)
    for window, cap in [(0, 0.0), (5, 30.0)]:
        a = ops.paged_attention(q, kc, vc, bt, sid, pos, 0.3, window, cap, impl="c")
        b = ops.paged_attention(q, kc, vc, bt, sid, pos, 0.3, window, cap, impl=variant)
        assert torch.equal(a, b)
    x = torch.randn(6, 100)
    wn = torch.randn(100)
    assert torch.equal(ops.rms_norm(x, wn, 1e-6, impl="c"), ops.rms_norm(x, wn, 1e-6, impl=variant))


def _extreme_weight(fmt: str, n: int, k: int) -> ops.GGUFBlockWeight:
    """Every weight value at its format's largest (all quant bits set), sub-block scales at their
    extremes (Q4_K 63, Q6_K -128 and 127 on alternate channels), small f16 block scales."""
    _, be, bb = ops.GGUF_QTYPES[fmt]
    raw = np.full((n, k // be, bb), 0xFF, dtype=np.uint8)
    d = np.full((n, k // be), 1e-3, np.float16).view(np.uint8).reshape(n, k // be, 2)
    if fmt == "Q6_K":  # ql, qh, scales, d
        raw[..., 192:208] = 0x80
        raw[1::2, :, 192:208] = 0x7F
        raw[..., 208:210] = d
    else:  # d first; Q4_1's m and Q4_K's dmin next
        raw[..., 0:2] = d
        if fmt in ("Q4_1", "Q4_K"):
            raw[..., 2:4] = d
    return ops.GGUFBlockWeight.from_raw(torch.from_numpy(raw.reshape(n, -1)), fmt, n, k)


@needs_c
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_int_dot_extreme_values_same_bits_in_every_build(fmt):
    """The largest weights against activations all at +-127: the builds without VNNI add several
    chunks' maddubs pair sums in int16 lanes (linear_q8.h gives the bounds), which must not saturate;
    every build must give the scalar build's bits."""
    n, k = 35, 512
    w = _extreme_weight(fmt, n, k)
    x = torch.ones(5, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, ::3] = 0.0
    x[4] = torch.randn(k)
    ref = ops.linear(x, w, None, impl="c-scalar")
    assert torch.isfinite(ref).all()
    for variant in ("c", "c-avx2", "c-novnni"):
        try:
            ops._select(variant)
        except ops.KernelError:  # e.g. a non-x86 host
            continue
        for m in (1, 5):
            assert torch.equal(ops.linear(x[:m], w, None, impl=variant), ref[:m]), (variant, m)


@pytest.mark.parametrize("fmt", ["f32", "int8", "Q4_1"])
def test_linear_fallback_invariance(fmt):
    n, k = _shape_for(fmt)
    w = make_weight(fmt, n, k, seed=5)
    x = torch.randn(9, k)
    bias = torch.randn(n)
    single = [ops.linear(x[i:i + 1], w, bias, impl="torch")[0] for i in range(9)]
    for threads in (2, 1):
        _set_threads(threads)
        for m in (1, 2, 3, 8, 9):
            y = ops.linear(x[:m], w, bias, impl="torch")
            assert all(torch.equal(y[i], single[i]) for i in range(m)), (fmt, threads, m)


def test_linear_fallback_env(monkeypatch):
    w = make_weight("int8", 16, 64)
    x = torch.randn(3, 64)
    try:
        monkeypatch.setenv("SPECSERVE_KERNELS", "torch")
        ops.set_default_impl(None)  # re-read the environment
        assert ops.kernels_info()["default_impl"] in ("auto", "torch")
        a = ops.linear(x, w)
        assert ops.kernels_info()["default_impl"] == "torch"
        assert torch.equal(a, ops.linear(x, w, impl="torch"))
        monkeypatch.setenv("SPECSERVE_KERNELS", "bogus")
        ops.set_default_impl(None)
        with pytest.raises(ValueError):
            ops.linear(x, w)
        with pytest.raises(ValueError):
            ops.set_default_impl("bogus")
    finally:
        monkeypatch.delenv("SPECSERVE_KERNELS")
        ops.set_default_impl(None)


def test_linear_argument_checks():
    w = make_weight("f32", 8, 32)
    with pytest.raises(ValueError, match="float32"):
        ops.linear(torch.randn(2, 32, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="K=32"):
        ops.linear(torch.randn(2, 31), w)
    with pytest.raises(ValueError, match="contiguous"):
        ops.linear(torch.randn(32, 2).T, w)
    with pytest.raises(ValueError, match="bias"):
        ops.linear(torch.randn(2, 32), w, torch.randn(7))
    with pytest.raises(TypeError):
        ops.linear(torch.randn(2, 32), "nope")
    # plain tensors are taken as fp32 weights; leading dims are kept
    x = torch.randn(2, 3, 32)
    y = ops.linear(x, w.w)
    assert y.shape == (2, 3, 8)
    assert torch.equal(y.reshape(6, 8), ops.linear(x.reshape(6, 32), w))
    # a row-strided 2-D view (e.g. a slice of a fused projection) is accepted
    big = torch.randn(4, 64)
    assert torch.equal(ops.linear(big[:, :32], w), ops.linear(big[:, :32].contiguous(), w))


# --------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------


def _attention_case(D=64, Hq=6, Hkv=2, BS=16, lengths=(37, 70), seed=0, score_scale=1.0):
    """Two sequences sharing one block pool with scattered block ids.
    Every position of each sequence has a query (prefill-like)."""
    g = torch.Generator().manual_seed(seed)
    nblocks_needed = [(L + BS - 1) // BS for L in lengths]
    NB = sum(nblocks_needed) + 5
    perm = torch.randperm(NB, generator=g).to(torch.int32)
    maxb = max(nblocks_needed) + 1
    bt = torch.full((len(lengths), maxb), -1, dtype=torch.int32)  # unused entries invalid
    o = 0
    for s, nb in enumerate(nblocks_needed):
        bt[s, :nb] = perm[o:o + nb]
        o += nb
    kc = torch.randn(NB, BS, Hkv, D, generator=g) * score_scale
    vc = torch.randn(NB, BS, Hkv, D, generator=g)
    sid = torch.cat([torch.full((L,), s, dtype=torch.int32) for s, L in enumerate(lengths)])
    pos = torch.cat([torch.arange(L, dtype=torch.int32) for L in lengths])
    q = torch.randn(len(sid), Hq, D, generator=g)
    return q, kc, vc, bt, sid, pos


def _dense_reference(q, kc, vc, bt, sid, pos, scale, window=0, softcap=0.0):
    """float64 attention per sequence on the gathered (dense) keys/values."""
    T, Hq, D = q.shape
    _, BS, Hkv, _ = kc.shape
    group = Hq // Hkv
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    for s in sid.unique().tolist():
        idx = (sid == s).nonzero().flatten()
        qpos = pos[idx].long()
        kp = torch.arange(int(qpos.max()) + 1)
        blocks = bt[s].long()[kp // BS]
        k = kc[blocks, kp % BS].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = vc[blocks, kp % BS].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->thl", q[idx].double(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        masked = kp[None, :] > qpos[:, None]
        if window > 0:
            masked |= kp[None, :] <= qpos[:, None] - window
        scores = scores.masked_fill(masked[:, None, :], float("-inf"))
        out[idx] = torch.einsum("thl,lhd->thd", torch.softmax(scores, -1), v)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "D,Hq,Hkv,window,cap",
    [(64, 6, 2, 0, 0.0), (128, 4, 4, 0, 0.0), (256, 8, 4, 0, 0.0), (64, 6, 3, 9, 0.0),
     (36, 4, 1, 0, 5.0), (64, 4, 2, 17, 20.0), (32, 130, 1, 0, 0.0)],  # 130 heads per kv head: 3 items
)
def test_paged_attention_matches_dense(impl, D, Hq, Hkv, window, cap):
    q, kc, vc, bt, sid, pos = _attention_case(D=D, Hq=Hq, Hkv=Hkv, score_scale=3.0 if cap else 1.0)
    scale = D ** -0.5
    out = ops.paged_attention(q, kc, vc, bt, sid, pos, scale, window, cap, impl=impl)
    ref = _dense_reference(q, kc, vc, bt, sid, pos, scale, window, cap)
    assert out.shape == q.shape
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("D,Hq,Hkv,window,cap", [(64, 6, 2, 0, 0.0), (64, 6, 3, 9, 0.0), (64, 4, 2, 17, 20.0)])
def test_device_paged_attention_matches_dense_and_is_batch_invariant(D, Hq, Hkv, window, cap):
    """The CUDA path's torch attention (run here on CPU tensors): prefill runs, single decode
    rows, and rows of one sequence split into several runs all match the dense reference, and
    every row gets the bits it gets alone, whatever else is in the step."""
    from specserve.models import device_attention

    def run(idx):
        return device_attention.paged_attention(q[idx], kc, vc, bt, sid[idx], pos[idx], scale, window, cap)

    q, kc, vc, bt, sid, pos = _attention_case(D=D, Hq=Hq, Hkv=Hkv, score_scale=3.0 if cap else 1.0)
    scale = D ** -0.5
    ref = _dense_reference(q, kc, vc, bt, sid, pos, scale, window, cap)
    everything = torch.arange(q.shape[0])
    out = run(everything)
    assert out.shape == q.shape and (out.double() - ref).abs().max() < 1e-5
    idx = torch.tensor([40, 3, 41, 100, 5, 36, 106])  # interleaved sequences, mixed positions
    assert torch.equal(run(idx), out[idx])
    for i in (0, 3, 40, 106):  # alone, and as the only short row beside the longest context
        assert torch.equal(run(torch.tensor([i]))[0], out[i])
        assert torch.equal(run(torch.tensor([i, int(pos.argmax())]))[0], out[i])


def test_device_linear_rows_do_not_depend_on_the_other_rows():
    from specserve.models.layers import device_linear

    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 80, generator=g), torch.randn(96, generator=g), torch.randn(150, 80, generator=g)
    out = device_linear(x, w, b, tile=64)
    assert out.shape == (150, 96) and torch.allclose(out, torch.nn.functional.linear(x, w, b), atol=1e-4)
    for rows in (slice(0, 1), slice(3, 11), slice(60, 130), slice(149, 150)):
        assert torch.equal(device_linear(x[rows], w, b, tile=64), out[rows])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("D,Hq,Hkv,cap", [(64, 6, 2, 0.0), (36, 4, 1, 5.0), (100, 8, 2, 0.0), (128, 4, 4, 0.0),
                                         (32, 130, 1, 0.0)])
@pytest.mark.parametrize("window", [0, 9])
def test_paged_attention_grouping_invariance(impl, D, Hq, Hkv, cap, window):
    """Prefill-like runs (rows of one sequence share each K / V row between them and the group's
    heads in the C kernel; with a window, rows at consecutive positions) give every row the bits
    it gets alone or in any other batch."""
    q, kc, vc, bt, sid, pos = _attention_case(D=D, Hq=Hq, Hkv=Hkv, lengths=(29, 45), score_scale=3.0 if cap else 1.0)
    T = q.shape[0]
    args = dict(scale=D ** -0.5, sliding_window=window, softcap=cap, impl=impl)
    full = ops.paged_attention(q, kc, vc, bt, sid, pos, **args)
    # one query at a time (decode-like)
    for t in range(T):
        one = ops.paged_attention(q[t:t + 1], kc, vc, bt, sid[t:t + 1], pos[t:t + 1], **args)
        assert torch.equal(one[0], full[t]), t
    # random groupings / orders (verification blocks of mixed sequences)
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(T, generator=g)
    for size in (3, 8, 17):
        for i in range(0, T, size):
            idx = perm[i:i + size]
            part = ops.paged_attention(q[idx].contiguous(), kc, vc, bt, sid[idx].contiguous(),
                                       pos[idx].contiguous(), **args)
            assert torch.equal(part, full[idx])


@needs_c
@pytest.mark.parametrize("variant", ["c-avx2", "c-scalar"])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 8, 2), (100, 6, 3), (36, 4, 4), (64, 9, 3)])
def test_paged_attention_same_bits_in_every_build(variant, D, Hq, Hkv):
    """The AVX-512 (two query vectors per register, odd counts padded), AVX2 and scalar attention
    give the same bits on prefill-like runs (several rows of a sequence per work item) and single
    rows."""
    try:
        ops._select(variant)
    except ops.KernelError as e:
        pytest.skip(str(e))
    q, kc, vc, bt, sid, pos = _attention_case(D=D, Hq=Hq, Hkv=Hkv, lengths=(29, 75), score_scale=3.0)
    for window, cap in ((0, 0.0), (0, 20.0), (17, 0.0)):
        native = ops.paged_attention(q, kc, vc, bt, sid, pos, D ** -0.5, window, cap, impl="c")
        other = ops.paged_attention(q, kc, vc, bt, sid, pos, D ** -0.5, window, cap, impl=variant)
        assert torch.equal(native, other), (window, cap)


@needs_c
def test_paged_attention_thread_invariance():
    q, kc, vc, bt, sid, pos = _attention_case(D=128, Hq=4, Hkv=2, lengths=(50, 33))
    _set_threads(2)
    a = ops.paged_attention(q, kc, vc, bt, sid, pos, 0.1, 16, 0.0, impl="c")
    _set_threads(1)
    b = ops.paged_attention(q, kc, vc, bt, sid, pos, 0.1, 16, 0.0, impl="c")
    assert torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_paged_attention_index_errors(impl):
    q, kc, vc, bt, sid, pos = _attention_case(D=32, Hq=2, Hkv=1, lengths=(20,))
    bad = bt.clone()
    bad[0, 0] = kc.shape[0]  # block id out of range
    with pytest.raises(IndexError):
        ops.paged_attention(q, kc, vc, bad, sid, pos, 0.1, impl=impl)
    bad_pos = pos.clone()
    bad_pos[-1] = bt.shape[1] * kc.shape[1]  # beyond the block table
    with pytest.raises(IndexError):
        ops.paged_attention(q, kc, vc, bt, sid, bad_pos, 0.1, impl=impl)
    with pytest.raises(IndexError):
        ops.paged_attention(q, kc, vc, bt, sid + 1, pos, 0.1, impl=impl)
    with pytest.raises(ValueError):
        ops.paged_attention(q, kc, vc, bt, sid.long(), pos, 0.1, impl=impl)
    with pytest.raises(ValueError):
        ops.paged_attention(q[:, :, :16].contiguous(), kc, vc, bt, sid, pos, 0.1, impl=impl)


# --------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("unit", [False, True])
def test_rms_norm(impl, unit):
    K = 576
    x = torch.randn(max(ROW_COUNTS), K) * 3
    w = torch.randn(K)
    eps = 1e-6
    y = ops.rms_norm(x, w, eps, add_unit_offset=unit, impl=impl)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w.double()) if unit else w.double())
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    for threads in (2, 1):
        _set_threads(threads)
        for m in ROW_COUNTS:
            ym = ops.rms_norm(x[:m], w, eps, add_unit_offset=unit, impl=impl)
            assert torch.equal(ym, y[:m]), (threads, m)
    # leading dims
    assert torch.equal(ops.rms_norm(x[:8].reshape(2, 4, K), w, eps, unit, impl=impl).reshape(8, K), y[:8])


@pytest.mark.parametrize("impl", IMPLS)
def test_add_rms_norm(impl):
    x = torch.randn(9, 200)
    r = torch.randn(9, 200)
    w = torch.randn(200)
    out, h = ops.add_rms_norm(x, r, w, 1e-5, impl=impl)
    assert torch.equal(h, x + r)
    assert torch.equal(out, ops.rms_norm(x + r, w, 1e-5, impl=impl))
    out1, h1 = ops.add_rms_norm(x[4:5], r[4:5], w, 1e-5, impl=impl)
    assert torch.equal(out1[0], out[4]) and torch.equal(h1[0], h[4])


# --------------------------------------------------------------------------
# build / info
# --------------------------------------------------------------------------


def test_kernels_info():
    info = ops.kernels_info()
    for key in ("available", "library", "flags", "avx2", "num_threads"):
        assert key in info
    assert info["available"] == HAVE_C
    if HAVE_C:
        assert info["library"] and any(f.startswith("-O") for f in info["flags"])


@needs_c
def test_build_cache_reuse(tmp_path):
    a = build.build("scalar", directory=tmp_path)
    assert a.lib is not None and a.path.startswith(str(tmp_path))
    libs = list(tmp_path.glob("*.so"))
    assert len(libs) == 1 and not list(tmp_path.glob(".*.so"))  # no temp files left
    b = build.build("scalar", directory=tmp_path)  # cache hit: same file, no rebuild
    assert b.path == a.path and b.flags == a.flags
    assert list(tmp_path.glob("*.so")) == libs


def test_build_without_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    res = build.build("native", directory=tmp_path)
    assert res.lib is None and "compiler" in res.error


# --------------------------------------------------------------------------
# rope, act_mul
# --------------------------------------------------------------------------


def _rope_tables(D: int, max_pos: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return f.cos(), f.sin()


def _rope_torch(x, pos, cos, sin):
    c, s = cos[pos.long()].unsqueeze(1), sin[pos.long()].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@needs_c
@pytest.mark.parametrize("variant", ["c", "c-avx2", "c-scalar"])
@pytest.mark.parametrize("D", [2, 10, 26, 64, 128])
def test_rope_equals_torch_formula(variant, D):
    """Each product and sum rounded on its own: the very bits of the torch formula, in the vector
    loop and the scalar tail (D / 2 = 1, 5, 13: tails; 32, 64: vector only), in every build."""
    try:
        ops._select(variant)
    except ops.KernelError as e:
        pytest.skip(str(e))
    cos, sin = _rope_tables(D)
    T, H = 9, 3
    fused = torch.randn(T, 2 * H * D + 5) * 3  # q as a strided view of a wider (q|k|v-like) row
    x = fused[:, :H * D].view(T, H, D)
    pos = torch.randint(0, 300, (T,), dtype=torch.int32)
    got = ops.rope(x, pos, cos, sin, impl=variant)
    assert got.is_contiguous() and torch.equal(got, _rope_torch(x, pos, cos, sin))
    assert torch.equal(got, ops.rope(x, pos, cos, sin, impl="torch"))
    for t in (0, 4, T - 1):  # batch invariance
        assert torch.equal(ops.rope(x[t:t + 1], pos[t:t + 1], cos, sin, impl=variant), got[t:t + 1])


@needs_c
def test_rope_position_errors():
    cos, sin = _rope_tables(8, max_pos=10)
    x = torch.randn(2, 1, 8)
    for bad in (10, -1):
        with pytest.raises(IndexError):
            ops.rope(x, torch.tensor([0, bad], dtype=torch.int32), cos, sin, impl="c")


def _act_ref(g: torch.Tensor, u: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 act(g) * u, the exponent a of act(g) = g / (1 + exp(a))): gelu_tanh as
    g * sigmoid(2 u) (its 0.5 g (1 + tanh u) form cancels in float64 too for g << 0)."""
    g, u = g.double(), u.double()
    a = -g if act == "silu" else -2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)
    return g / (1 + torch.exp(a)) * u, a


def _act_inputs(T: int, N: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(T, N, generator=g) * 4
    gate.view(-1)[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-7, 20.0, -20.0, 95.0, -95.0])
    return gate, torch.randn(T, N, generator=g)


@needs_c
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_matches_torch(act):
    """Within a few ulp of the float64 result, close to torch's F.silu / F.gelu (the torch fallback,
    which cancels in float32 for gelu's negative tail)."""
    gate, up = _act_inputs(7, 301)
    got = ops.act_mul(gate, up, act, impl="c")
    ref, a = _act_ref(gate, up, act)
    err = (got.double() - ref).abs()
    # a few ulp, plus the rounding of gelu's exponent a (float32) that exp turns into |a| ulp
    tol = (4 + (a.abs() if act == "gelu_tanh" else 0)) * torch.finfo(torch.float32).eps * ref.abs() + 1e-30
    assert bool((err <= tol).all()), float((err / ref.abs().clamp_min(1e-30)).max())
    torch.testing.assert_close(got, ops.act_mul(gate, up, act, impl="torch"), rtol=1e-6, atol=1e-6)


@needs_c
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_vector_scalar_and_batch_invariance(act):
    """The AVX2 loop and the scalar tail give the same bits for the same values (rows of 13 and 29:
    the same values in the vector loop at two offsets and in the tail), as do the AVX2 and scalar
    builds; rows are independent."""
    gate, up = _act_inputs(5, 8)
    g13, u13 = torch.cat([gate, gate[:, :5]], 1), torch.cat([up, up[:, :5]], 1)
    got = ops.act_mul(g13, u13, act, impl="c")
    assert torch.equal(got[:, 8:], got[:, :5])
    g16, u16 = _act_inputs(5, 16, seed=5)
    got29 = ops.act_mul(torch.cat([g16, g16[:, :8], g16[:, :5]], 1), torch.cat([u16, u16[:, :8], u16[:, :5]], 1),
                        act, impl="c")
    assert torch.equal(got29[:, 16:24], got29[:, :8]) and torch.equal(got29[:, 24:], got29[:, :5])
    fused = torch.cat([gate, up], 1)  # gate|up halves as strided views
    assert torch.equal(ops.act_mul(fused[:, :8], fused[:, 8:], act, impl="c"), got[:, :8])
    for t in range(5):
        assert torch.equal(ops.act_mul(g13[t:t + 1], u13[t:t + 1], act, impl="c"), got[t:t + 1])
    big_g, big_u = _act_inputs(3, 77, seed=3)
    ref = ops.act_mul(big_g, big_u, act, impl="c")
    for variant in ("c-avx2", "c-scalar"):
        try:
            ops._select(variant)
        except ops.KernelError:
            continue
        assert torch.equal(ops.act_mul(big_g, big_u, act, impl=variant), ref), variant
