"""Several weights of one format and shape, each times its own rows, in one kernel call: a mixture
of experts' experts (ss_linear_q8_group). One fork and join of the threads for all of them, and the
weights streamed back to back, where one call per expert paid both per expert. Every row's bits
equal :func:`linear` per weight (the same arithmetic per output)."""

from __future__ import annotations

import ctypes

import torch

from .library import _check, _FMT_PANEL, _select, get_num_threads
from .linear import GGUFBlockWeight, Int8Weight

_vp, _i64 = ctypes.c_void_p, ctypes.c_int64


def groupable(weights: list) -> bool:
    """Whether one call can take these weights: all panel-packed on the integer-dot path, of one
    type, format and shape, and the C library loaded."""
    if not weights or _select(None) is None:
        return False
    w0 = weights[0]
    if not isinstance(w0, (GGUFBlockWeight, Int8Weight)):
        return False
    kind, fmt, shape = type(w0), w0._c_args()[1], w0.shape
    return all(type(w) is kind and w.act_block and w._c_args()[1] == fmt and w.shape == shape for w in weights) \
        and bool(fmt & _FMT_PANEL)


def linear_group(xs: list[torch.Tensor], weights: list, out: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """out [sum M_g, N] = the rows of xs[g] [M_g, K] (float32, rows contiguous) times weights[g]^T,
    stacked in order; the weights must be :func:`groupable`. ``impl``: the build, as for linear()."""
    lib = _select(impl)
    if lib is None:
        raise ValueError("linear_group needs the C kernels")
    n, k = weights[0].shape
    ng = len(weights)
    args = [w._c_args() for w in weights]
    ms = [x.shape[0] for x in xs]
    if sum(ms) != out.shape[0] or out.shape[1] != n or not out.is_contiguous():
        raise ValueError(f"linear_group: out must be a contiguous [{sum(ms)}, {n}] tensor")
    outs, at = [], 0
    for x, m in zip(xs, ms):
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or (m > 1 and x.stride(0) != k) \
                or x.stride(1) != 1:
            raise ValueError(f"linear_group: inputs must be float32 [M, {k}] with contiguous rows")
        outs.append(out.data_ptr() + at * n * 4)
        at += m
    scales = (_vp * ng)(*[a[3] for a in args]) if isinstance(weights[0], Int8Weight) else None
    rc = lib.ss_linear_q8_group(ng, (_vp * ng)(*[x.data_ptr() for x in xs]), (_i64 * ng)(*ms), k,
                                (_vp * ng)(*[a[0] for a in args]), args[0][1], scales, (_vp * ng)(*outs), n,
                                get_num_threads())
    if rc:
        _check(rc, "linear_group")
    return out
