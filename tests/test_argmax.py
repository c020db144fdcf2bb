"""Greedy decoding's argmax in C (ops.argmax_rows) gives torch.argmax's index in every SIMD build:
the first of equal maxima, a NaN as the largest, rows of any length (vector tails), strided rows."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels import ops

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="C kernels unavailable (no compiler?)")


@pytest.mark.parametrize("impl", ["c", "c-avx2", "c-scalar", "c-novnni"])
def test_argmax_rows_is_torchs(impl):
    try:
        ops._select(impl)
    except ops.KernelError as e:  # e.g. a non-x86 host for c-avx2
        pytest.skip(str(e))
    g = torch.Generator().manual_seed(7)
    for n in (1, 7, 16, 33, 151_936):
        x = torch.randn(5, n, generator=g)
        assert ops.argmax_rows(x, impl=impl) == x.argmax(-1).tolist()
    x = torch.randn(6, 100, generator=g)
    x[0, [5, 17, 99]] = 9.0  # ties: the first
    x[1, [40, 3]] = float("nan")  # a NaN counts as the largest: the first NaN
    x[2, 60] = float("inf")
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 97] = 50.0  # in the scalar tail after the vector loop
    x[5, [0, 64]] = 8.0
    assert ops.argmax_rows(x, impl=impl) == x.argmax(-1).tolist() == [5, 3, 60, 0, 97, 0]
    wide = torch.randn(3, 130, generator=g)
    assert ops.argmax_rows(wide[:, 2:120], impl=impl) == wide[:, 2:120].argmax(-1).tolist()  # strided rows
    assert ops.argmax_rows(torch.empty(0, 10), impl=impl) == []
