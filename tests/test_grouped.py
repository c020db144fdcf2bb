"""One kernel call over several weights, each times its own rows (kernels/grouped.py: a mixture of
experts' projections): every row's bits equal one linear call per weight, for every format of the
integer-dot path and row counts on both sides of the kernel's one-panel / panel-pair switch (16 rows);
the mixture's layer gives the same bits grouped or expert by expert."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import raw_blocks

from specserve.kernels import ops
from specserve.kernels.grouped import groupable, linear_group

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
    output over a batch of rows is the same bits grouped and one expert at a time."""
    from hybrid_utils import DATA

    from specserve.models.layers import route_top_k
    from specserve.models.loader import load_model

    mlp = load_model(str(DATA / "tiny-qwen35moe-q8_0.gguf")).model.layers[0].mlp
    h = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    _, groups = route_top_k(mlp.router(h), mlp.moe.num_experts_per_tok, True)
    assert mlp.can_group()
    grouped = mlp.forward(h)
    one_by_one = [mlp.experts[e](h[rows]) for e, rows, _ in groups]
    assert all(torch.equal(a, b) for a, b in zip(mlp.expert_outputs(h, groups), one_by_one))
    mlp._groupable = False  # expert by expert
    assert torch.equal(mlp.forward(h), grouped)
    mlp._groupable = None
    assert mlp.forward(h[:0]).shape == (0, 64)  # no rows: no expert
