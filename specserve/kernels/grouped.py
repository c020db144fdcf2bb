"""A mixture of experts' kernels, one call each per layer where torch took a few ops per expert.
``moe_route``: each row's top k experts and their weights (ss_moe_route). ``linear_group``: several
weights of one format and shape, each times its own rows, in one kernel call (ss_linear_q8_group):
one fork and join of the threads for all of them, and the weights streamed back to back; every
row's bits equal :func:`linear` per weight (the same arithmetic per output). ``moe_combine``: each
row's expert outputs weighted and summed in a fixed order, and the shared expert's added
(ss_moe_combine; csrc/moe.c)."""

from __future__ import annotations

import ctypes

import torch

from .library import _check, _FMT_PANEL, _select, get_num_threads
from .linear import GGUFBlockWeight, Int8Weight
from .recurrent import sigmoid_mul

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


def top_k_experts(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing in torch (differentiable; any device): logits [T, E] ->
    (weight [T, k], chosen [T, k]): softmax over the experts, the top k per row, their weights
    renormalised to sum to 1 when ``renormalise``, then each row's experts in ascending order (the
    order a row adds their outputs in)."""
    weight, chosen = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)  # [T, k]
    if renormalise:
        weight = weight / weight.sum(-1, keepdim=True)
    chosen, perm = chosen.sort(dim=-1)
    return weight.gather(-1, perm), chosen


def moe_route(logits: torch.Tensor, k: int, renormalise: bool, *, impl: str | None = None):
    """:func:`top_k_experts` in one C call per layer (ss_moe_route, csrc/moe.c: each row on its
    own, so batch-invariant) where the kernels are loaded and the logits are float32 on the CPU
    with contiguous rows; torch's otherwise."""
    lib = _select(impl) if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None or logits.dim() != 2 or logits.stride(-1) != 1 or k > 64:
        return top_k_experts(logits, k, renormalise)
    t, e = logits.shape
    weight, chosen = torch.empty(t, k), torch.empty(t, k, dtype=torch.int64)
    if t:
        _check(lib.ss_moe_route(logits.data_ptr(), t, e, logits.stride(0) if t > 1 else e, k, int(renormalise),
                                weight.data_ptr(), chosen.data_ptr()), "moe_route")
    return weight, chosen


def moe_combine(y: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None = None, *,
                impl: str | None = None) -> torch.Tensor:
    """out [M, N]: row m's experts' outputs, rows idx[m, :K] of y [R, N], times w [M, K] and summed
    in that order; with ``gate`` [M], plus row idx[m, K] times sigmoid(gate[m]) (the shared expert).
    y, w float32 and contiguous, idx int64 [M, K (+1)]. The torch fallback takes the same steps
    over all rows at once (each an exactly rounded product or sum) and the sigmoid as sigmoid_mul."""
    m, k = w.shape
    n = y.shape[1]
    if idx.shape != (m, k + (gate is not None)) or idx.dtype != torch.int64 or (gate is not None and gate.shape != (m,)):
        raise ValueError(f"moe_combine: idx {tuple(idx.shape)} / gate do not fit weights {tuple(w.shape)}")
    lib = _select(impl)
    if lib is None:
        rows = y[idx]  # [M, K (+1), N]
        out = rows[:, 0] * w[:, :1]
        for e in range(1, k):
            out = out + rows[:, e] * w[:, e:e + 1]
        if gate is not None:
            out = out + sigmoid_mul(gate[:, None].expand(m, n).contiguous(), rows[:, k].contiguous(), impl=impl)
        return out
    y, idx, w = y.contiguous(), idx.contiguous(), w.contiguous()
    gate = None if gate is None else gate.contiguous()
    out = torch.empty(m, n)
    rc = lib.ss_moe_combine(y.data_ptr(), y.shape[0], idx.data_ptr(), w.data_ptr(), m, k, n,
                            None if gate is None else gate.data_ptr(), out.data_ptr(), get_num_threads())
    if rc:
        _check(rc, "moe_combine")
    return out
