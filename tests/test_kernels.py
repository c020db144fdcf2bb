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

from kernel_utils import IMPLS, ROW_COUNTS, attention_case, needs_c, set_threads
from specserve.kernels import ops

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: single-threaded unless a test compares


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
    set_threads(1)
    single = torch.stack([ops.linear(x[i:i + 1], w, bias, impl="c")[0] for i in range(40)])
    ref = _ref_linear(x, w, bias)
    assert float((single.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    for threads in (1, 2, 3):
        set_threads(threads)
        for m in range(1, 41):
            assert torch.equal(ops.linear(x[:m], w, bias, impl="c"), single[:m]), (fmt, threads, m)
        for start in (1, 3, 6):  # the same rows at other positions in the call
            assert torch.equal(ops.linear(x[start:start + 29], w, bias, impl="c"), single[start:start + 29])


@needs_c
def test_int_dot_large_m():
    """More rows than one 64-row super tile, with rows of very different magnitudes."""
    w = make_weight("Q4_1", 21, 576, seed=8)
    x = torch.randn(150, 576) * torch.logspace(-4, 4, 150)[:, None]
    set_threads(2)
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
    set_threads(2)
    single = [ops.linear(x[i:i + 1], w, bias, impl="c")[0] for i in range(x.shape[0])]
    for threads in (2, 1):
        set_threads(threads)
        for m in ROW_COUNTS:
            y = ops.linear(x[:m], w, bias, impl="c")
            for i in range(m):
                assert torch.equal(y[i], single[i]), (fmt, threads, m, i)
    # a row in the middle of a large (prefill-like) call with other offsets
    set_threads(2)
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
    q, kc, vc, bt, sid, pos = attention_case(D=72, Hq=4, Hkv=2)
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
        set_threads(threads)
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


@needs_c
@pytest.mark.parametrize("key", [0, 5, 5 + 2**32, 2**64 - 1])
def test_uniform_noise_c_equals_torch(key):
    """A seeded request's noise: the C kernel and the torch fallback give the same bits (its text
    cannot depend on which ran); the values are uniform in (0, 1) and differ between keys."""
    from specserve.kernels.noise import uniform_noise

    got = uniform_noise(key, 50_000, impl="c")
    assert torch.equal(got, uniform_noise(key, 50_000, impl="torch"))
    assert 0 < float(got.min()) and float(got.max()) < 1 and abs(float(got.mean()) - 0.5) < 0.01
    assert torch.equal(uniform_noise(key, 100), got[:100])  # element i depends on (key, i) alone
    assert not torch.equal(uniform_noise(key ^ 1, 100), got[:100])
