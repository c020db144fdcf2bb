"""One kernel call over several weights, each times its own rows (kernels/grouped.py: a mixture of
experts' projections): every row's bits equal one linear call per weight, for every format of the
integer-dot path and row counts on both sides of the kernel's one-panel / panel-pair switch (16 rows);
the mixture's layer gives the same bits grouped or expert by expert."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import raw_blocks

from specserve.kernels import ops
from specserve.kernels.grouped import groupable, linear_group, moe_combine, moe_route, top_k_experts

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="C kernels unavailable (no compiler?)")


def weights(qtype: str, n: int, k: int, count: int) -> list:
    if qtype == "int8":
        g = torch.Generator().manual_seed(1)
        return [ops.Int8Weight.from_float(torch.randn(n, k, generator=g)) for _ in range(count)]
    return [ops.GGUFBlockWeight.from_raw(raw_blocks(qtype, n, k, seed=s), qtype, n, k) for s in range(count)]


@pytest.mark.parametrize("impl", ["c", "c-avx2", "c-scalar", "c-novnni"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "int8"])
def test_grouped_rows_equal_one_call_per_weight(qtype, impl):
    """In every build (AVX-512, AVX2, scalar, AVX-512 without VNNI), against the chosen build's linear."""
    n, k = 40, 512  # N: two panels and a part
    ws = weights(qtype, n, k, 5)
    assert groupable(ws)
    g = torch.Generator().manual_seed(2)
    ms = [1, 0, 3, 17, 1]  # an expert with no rows; 17 rows take the panel-pair walk
    x = torch.randn(sum(ms), k, generator=g)
    xs = list(x.split(ms))
    xs[2] = torch.randn(3, 2 * k, generator=g)[:, :k]  # rows with a stride: refused below
    try:
        ops._select(impl)
    except ops.KernelError as e:  # e.g. a non-x86 host for c-avx2
        pytest.skip(str(e))
    with pytest.raises(ValueError, match="contiguous rows"):
        linear_group(xs, ws, torch.empty(sum(ms), n), impl=impl)
    xs[2] = xs[2].contiguous()
    got = linear_group(xs, ws, torch.empty(sum(ms), n), impl=impl)
    want = torch.cat([ops.linear(xi, w) for xi, w in zip(xs, ws)])
    assert torch.equal(got, want)


def test_what_one_call_cannot_take():
    q8, q4 = weights("Q8_0", 16, 256, 1), weights("Q4_K", 16, 256, 1)
    assert not groupable(q8 + q4)  # two formats
    assert not groupable(q8 + weights("Q8_0", 32, 256, 1))  # two shapes
    assert not groupable([ops.F32Weight(torch.randn(16, 256))])  # float32: the fp32 path
    assert not groupable([])


def test_mixture_layer_grouped_equals_expert_by_expert():
    """The tiny Qwen3.5-MoE as llama-quantize's Q8_0 (the experts' blocks kept): its MoE layer's
    output over a batch of rows is the same bits grouped and one expert at a time, and each row's
    the same as alone."""
    from hybrid_utils import DATA

    from specserve.models.loader import load_model

    mlp = load_model(str(DATA / "tiny-qwen35moe-q8_0.gguf")).model.layers[0].mlp
    h = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    _, chosen = moe_route(mlp.router(h), mlp.moe.num_experts_per_tok, True)
    assert mlp.can_group() and not mlp._fold_shared  # its shared expert: another width and format
    y, idx = mlp.expert_outputs(h, chosen)
    for t in range(9):  # row t's outputs: its experts', ascending, then the shared expert's
        want = [mlp.experts[e](h[t:t + 1])[0] for e in chosen[t].tolist()] + [mlp.shared(h[t:t + 1])[0]]
        assert torch.equal(y[idx[t]], torch.stack(want))
    grouped = mlp.forward(h)
    assert all(torch.equal(mlp.forward(h[t:t + 1])[0], grouped[t]) for t in range(9))
    mlp._groupable = False  # expert by expert
    assert torch.equal(mlp.forward(h), grouped)
    mlp._groupable = None
    assert mlp.forward(h[:0]).shape == (0, 64)  # no rows: no expert


def test_shared_expert_in_the_routed_experts_call(tmp_path):
    """A shared expert as wide as the routed ones, all int8: it joins their kernel calls, and the
    layer's bits are those of its own calls, and of one call per expert."""
    from tiny_models import make_tiny_qwen3_5_moe

    from specserve.models.loader import LoadOptions

    loaded, _ = make_tiny_qwen3_5_moe(tmp_path, options=LoadOptions(device="cpu", quantization="int8"), mtp=False,
                                      shared_intermediate=32)
    mlp = loaded.model.layers[0].mlp
    assert mlp.can_group() and mlp._fold_shared
    h = torch.randn(7, mlp.router.in_features, generator=torch.Generator().manual_seed(4))
    folded = mlp.forward(h)
    mlp._fold_shared = False
    assert torch.equal(mlp.forward(h), folded)
    mlp._groupable = False
    assert torch.equal(mlp.forward(h), folded)
    mlp._groupable = None
    assert torch.equal(mlp.forward(h[2:3])[0], folded[2]) and mlp._fold_shared


@pytest.mark.parametrize("impl", ["c", "torch"])
def test_moe_combine(impl):
    """Each row's experts weighted and summed in idx order, then the shared expert behind its
    sigmoid gate: the bits of those steps in torch one expert at a time; bad indices refused."""
    g = torch.Generator().manual_seed(5)
    y, w, gate = torch.randn(11, 24, generator=g), torch.rand(3, 2, generator=g), torch.randn(3, generator=g)
    idx = torch.tensor([[0, 4, 9], [1, 5, 10], [7, 2, 8]])
    want = torch.zeros(3, 24)
    for e in range(2):
        want += y[idx[:, e]] * w[:, e:e + 1]
    plain = moe_combine(y, idx[:, :2].contiguous(), w, impl=impl)
    assert torch.equal(plain, want)
    assert torch.equal(moe_combine(y, idx, w, gate, impl=impl), want + ops.sigmoid_mul(
        gate[:, None].expand(3, 24).contiguous(), y[idx[:, 2]], impl=impl))
    with pytest.raises(ValueError, match="do not fit"):
        moe_combine(y, idx, w, impl=impl)  # a shared column without a gate
    if impl == "c":
        with pytest.raises(ValueError, match="invalid arguments"):
            moe_combine(y, torch.tensor([[0, 11], [1, 2], [3, 4]]), w, impl=impl)  # row 11 of 11


def test_moe_route_is_torchs_routing():
    """The C routing picks torch's experts and weights (within a few ulp: another softmax sum
    order), each row's experts ascending; a row's result does not depend on the others; ties go
    to the lower index; bad shapes are refused."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(33, 40, generator=g) * 3
    logits[5, [3, 17, 30]] = logits[5].max() + 1  # a three-way tie at the top
    for renorm in (True, False):
        w, chosen = moe_route(logits, 8, renorm, impl="c")
        tw, tchosen = top_k_experts(logits, 8, renorm)
        assert torch.equal(chosen, tchosen) and torch.allclose(w, tw, rtol=1e-6, atol=0)
        assert bool((chosen.diff(dim=-1) > 0).all())
        one = [moe_route(logits[t:t + 1], 8, renorm, impl="c") for t in range(33)]
        assert torch.equal(torch.cat([o[0] for o in one]), w) and torch.equal(torch.cat([o[1] for o in one]), chosen)
    w, chosen = moe_route(logits[5:6], 2, True, impl="c")
    assert chosen.tolist() == [[3, 17]] and w.tolist() == [[0.5, 0.5]]
    strided = torch.randn(4, 50, generator=g)[:, :40]  # rows with a stride
    assert torch.equal(moe_route(strided, 4, True, impl="c")[1], top_k_experts(strided, 4, True)[1])
    with pytest.raises(ValueError):
        moe_route(logits, 41, True, impl="c")
