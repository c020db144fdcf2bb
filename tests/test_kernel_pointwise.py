"""Tests of the pointwise CPU kernels (RMSNorm, rope, act_mul) against torch's formulas, bit for bit
across builds, rows and threads, and of the kernel build itself (info, cache reuse, no compiler)."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import HAVE_C, IMPLS, ROW_COUNTS, needs_c, set_threads
from specserve.kernels import build, ops

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: single-threaded unless a test compares


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
        set_threads(threads)
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
