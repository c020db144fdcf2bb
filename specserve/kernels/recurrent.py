"""The Gated DeltaNet token mixer of hybrid models (csrc/deltanet.c), with a torch fallback.

Both paths run a sequence's rows token by token with fixed shapes per token, so a row's result
does not depend on how many rows share the call: prefill, chunked prefill, decode and
verification give the same bits (the C path and the torch fallback differ from each other in
the last bits: exp/log come from different libraries)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import _check, _select, get_num_threads

_EPS = 1e-6


def _addresses(planes: list[torch.Tensor | None] | None, n: int) -> torch.Tensor | None:
    """An int64 [n] tensor of data pointers (0 = not written), or None when nothing is written."""
    if not planes or all(p is None for p in planes):
        return None
    if len(planes) != n:
        raise ValueError(f"gated_delta: {len(planes)} output planes for {n} rows")
    return torch.tensor([0 if p is None else p.data_ptr() for p in planes], dtype=torch.int64)


def _check_plane(t: torch.Tensor | None, shape: tuple[int, ...], name: str) -> None:
    if t is not None and not (t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == shape):
        raise ValueError(f"gated_delta: {name} must be a contiguous float32 tensor of shape {shape}, "
                         f"got {t.dtype} {tuple(t.shape)}")


def gated_delta(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_wt: torch.Tensor, A: torch.Tensor,
                dt_bias: torch.Tensor, heads: tuple[int, int, int, int], conv_in: torch.Tensor | None,
                state_in: torch.Tensor | None, conv_out: list[torch.Tensor | None] | None = None,
                state_out: list[torch.Tensor | None] | None = None, *, v_tiled: bool = False,
                impl: str | None = None) -> torch.Tensor:
    """One sequence's n rows through conv + SiLU + the gated delta rule -> out [n, Hv, dv].

    qkv: [n, C] (C = 2 Hk dk + Hv dv; row-strided views are read in place); a, b: [n, Hv];
    conv_wt: [K, C]; A (= -exp(A_log)), dt_bias: [Hv]; heads = (Hk, Hv, dk, dv); conv_in
    [K-1, C] / state_in [Hv, dk, dv]: the window and state before row 0 (None: zeros).
    conv_out / state_out: one tensor (or None) per row, receiving the window / state after it.
    v_tiled: value head h reads key head h % Hk (llama.cpp's order), else h // (Hv / Hk)."""
    hk, hv, dk, dv = heads
    n, c = qkv.shape
    k = conv_wt.shape[0]
    if c != 2 * hk * dk + hv * dv or conv_wt.shape != (k, c):
        raise ValueError(f"gated_delta: qkv [{n}, {c}] and conv_wt {tuple(conv_wt.shape)} do not match heads {heads}")
    _check_plane(conv_in, (k - 1, c), "conv_in")
    _check_plane(state_in, (hv, dk, dv), "state_in")
    for p in (conv_out or []):
        _check_plane(p, (k - 1, c), "conv_out")
    for p in (state_out or []):
        _check_plane(p, (hv, dk, dv), "state_out")
    lib = _select(impl)
    if lib is None:
        return _gated_delta_torch(qkv, a, b, conv_wt, A, dt_bias, heads, conv_in, state_in, conv_out, state_out,
                                  v_tiled)
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    if not (a.stride(1) == 1 and b.stride(1) == 1 and a.stride(0) == b.stride(0)):
        a, b = a.contiguous(), b.contiguous()
    out = torch.empty(n, hv, dv, dtype=torch.float32)
    co, so = _addresses(conv_out, n), _addresses(state_out, n)
    _check(lib.ss_gated_delta(n, hk, hv, dk, dv, k, qkv.data_ptr(), qkv.stride(0) if n > 1 else c,
                              a.data_ptr(), b.data_ptr(), a.stride(0) if n > 1 else hv, conv_wt.data_ptr(),
                              A.data_ptr(), dt_bias.data_ptr(), None if conv_in is None else conv_in.data_ptr(),
                              None if state_in is None else state_in.data_ptr(),
                              None if co is None else co.data_ptr(), None if so is None else so.data_ptr(),
                              out.data_ptr(), int(v_tiled), get_num_threads()), "gated_delta")
    return out


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """x * sigmoid(gate) -> a new float32 [M, N]; gate, x: [M, N] with contiguous rows (the torch
    fallback goes one row per call, so a row's bits do not depend on M)."""
    if gate.shape != x.shape or gate.dim() != 2:
        raise ValueError(f"sigmoid_mul: gate {tuple(gate.shape)} and x {tuple(x.shape)} must be one [M, N] shape")
    m, n = x.shape
    lib = _select(impl)
    out = torch.empty(m, n, dtype=torch.float32)
    if lib is None:
        for r in range(m):
            out[r] = x[r] * torch.sigmoid(gate[r])
        return out
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    if m and n:
        _check(lib.ss_sigmoid_mul(gate.data_ptr(), x.data_ptr(), m, n, gate.stride(0) if m > 1 else n,
                                  x.stride(0) if m > 1 else n, out.data_ptr(), get_num_threads()), "sigmoid_mul")
    return out


def _gated_delta_torch(qkv, a, b, conv_wt, A, dt_bias, heads, conv_in, state_in, conv_out, state_out, v_tiled):
    """The same steps in torch, one row at a time (fixed shapes per row: batch-invariant)."""
    hk, hv, dk, dv = heads
    n, c = qkv.shape
    k = conv_wt.shape[0]
    window = torch.zeros(k - 1, c) if conv_in is None else conv_in.clone()
    S = torch.zeros(hv, dk, dv) if state_in is None else state_in.clone()
    out = torch.empty(n, hv, dv)
    rep = hv // hk
    for t in range(n):
        xx = torch.cat([window, qkv[t:t + 1].float()])  # [K, C]
        y = F.silu((conv_wt * xx).sum(0))  # [C]
        q, kk, v = y.split((hk * dk, hk * dk, hv * dv))
        q = q.view(hk, dk) * torch.rsqrt((q.view(hk, dk) ** 2).sum(-1, keepdim=True) + _EPS) * dk ** -0.5
        kk = kk.view(hk, dk) * torch.rsqrt((kk.view(hk, dk) ** 2).sum(-1, keepdim=True) + _EPS)
        spread = (lambda x: x.repeat(rep, 1)) if v_tiled else (lambda x: x.repeat_interleave(rep, 0))
        q, kk, v = spread(q), spread(kk), v.view(hv, dv)
        decay = torch.exp(A * F.softplus(a[t] + dt_bias))  # [Hv]
        beta = torch.sigmoid(b[t])
        S = S * decay[:, None, None]
        delta = (v - (S * kk[:, :, None]).sum(1)) * beta[:, None]  # [Hv, dv]
        S = S + kk[:, :, None] * delta[:, None, :]
        out[t] = (S * q[:, :, None]).sum(1)
        window = xx[1:]
        if conv_out and conv_out[t] is not None:
            conv_out[t].copy_(window)
        if state_out and state_out[t] is not None:
            state_out[t].copy_(S)
    return out
