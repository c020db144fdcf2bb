"""RMSNorm (with the residual add), rope and the gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import _check, _select, get_num_threads

# --------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, fn: str) -> int:
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.dim() >= 1
            and x.device.type == "cpu" and x.is_contiguous()):
        raise ValueError(f"{fn}: x must be a contiguous float32 CPU tensor")
    K = x.shape[-1]
    if not (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.dim() == 1
            and weight.shape[0] == K and weight.is_contiguous()):
        raise ValueError(f"{fn}: weight must be a contiguous float32 [{K}] tensor")
    return K


def _rms_row_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(var + eps)) * w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add_unit_offset: bool = False, *,
             impl: str | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w, with w = 1 + weight when add_unit_offset
    (Gemma). x: float32 [M, K] (or [..., K]); bit-identical per row for any M."""
    K = _check_norm_args(x, weight, "rms_norm")
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty_like(x2)
    lib = _select(impl)
    if lib is not None:
        if M:
            _check(lib.ss_rms_norm(x2.data_ptr(), M, K, K, weight.data_ptr(), float(eps), int(bool(add_unit_offset)),
                                   out.data_ptr(), K, get_num_threads()), "rms_norm")
    else:
        w = (1.0 + weight) if add_unit_offset else weight
        with torch.no_grad():
            for i in range(M):
                out[i:i + 1] = _rms_row_torch(x2[i:i + 1], w, eps)
    return out.reshape(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 add_unit_offset: bool = False, *, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; returns (rms_norm(h), h). Fused single pass in C."""
    K = _check_norm_args(x, weight, "add_rms_norm")
    if not (isinstance(residual, torch.Tensor) and residual.dtype == torch.float32
            and residual.shape == x.shape and residual.is_contiguous()):
        raise ValueError("add_rms_norm: residual must be a contiguous float32 tensor shaped like x")
    x2 = x.reshape(-1, K)
    r2 = residual.reshape(-1, K)
    M = x2.shape[0]
    lib = _select(impl)
    if lib is not None:
        h = torch.empty_like(x2)
        out = torch.empty_like(x2)
        if M:
            _check(lib.ss_add_rms_norm(x2.data_ptr(), r2.data_ptr(), M, K, weight.data_ptr(), float(eps),
                                       int(bool(add_unit_offset)), h.data_ptr(), out.data_ptr(),
                                       get_num_threads()), "add_rms_norm")
    else:
        h = x2 + r2  # elementwise: batch invariant
        out = torch.empty_like(x2)
        w = (1.0 + weight) if add_unit_offset else weight
        with torch.no_grad():
            for i in range(M):
                out[i:i + 1] = _rms_row_torch(h[i:i + 1], w, eps)
    return out.reshape(x.shape), h.reshape(x.shape)


# --------------------------------------------------------------------------
# rope, act_mul (the elementwise parts of a decoder layer)
# --------------------------------------------------------------------------


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         impl: str | None = None) -> torch.Tensor:
    """Half-split rotary embedding (HF's rotate_half layout) -> a new contiguous [T, heads, D].

    x: float32 [T, heads, D], heads contiguous (a view with a token stride, such as q of a fused
    q|k|v output, is read in place); positions: [T] int; cos, sin: float32 [max_pos, D / 2].
    out[..., :D/2] = x1 * cos - x2 * sin, out[..., D/2:] = x2 * cos + x1 * sin with x1, x2 the
    halves of x: every product and sum rounded on its own, the bits of the torch formula (the
    fallback). Elementwise per row: batch invariant.
    """
    T, heads, D = x.shape
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and D % 2 == 0
            and tuple(cos.shape) == (cos.shape[0], D // 2) and cos.shape == sin.shape):
        raise ValueError(f"rope: x must be a float32 CPU [T, heads, D] tensor with even D and tables "
                         f"[max_pos, D / 2], got x {x.dtype} {tuple(x.shape)}, cos {tuple(cos.shape)}")
    lib = _select(impl)
    if lib is None:
        c = cos[positions].unsqueeze(1)  # [T, 1, D/2]
        s = sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    if not (x.stride(2) == 1 and x.stride(1) == D and (T < 2 or x.stride(0) >= heads * D)):
        x = x.contiguous()
    if positions.dtype != torch.int32 or not positions.is_contiguous():
        positions = positions.to(torch.int32).contiguous()
    if not (positions.shape == (T,) and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
            and sin.is_contiguous()):
        raise ValueError("rope: positions must be [T] and the tables contiguous float32")
    out = torch.empty(T, heads, D, dtype=torch.float32)
    if T:
        _check(lib.ss_rope(x.data_ptr(), T, heads, D, x.stride(0) if T > 1 else heads * D, positions.data_ptr(),
                           cos.data_ptr(), sin.data_ptr(), cos.shape[0], out.data_ptr(), heads * D,
                           get_num_threads()), "rope")
    return out


# activation name -> C id (ss_act_mul)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", *,
            impl: str | None = None) -> torch.Tensor:
    """act(gate) * up -> a new contiguous float32 [T, N]; act: silu or gelu_tanh.

    gate, up: float32 [T, N] with contiguous rows (views with a row stride, such as the halves of a
    fused gate|up output, are read in place). C: silu(g) = g / (1 + exp(-g)), gelu_tanh(g) =
    g / (1 + exp(-2 sqrt(2/pi) (g + 0.044715 g^3))) with the kernels' exp (a few ulp from torch's
    F.silu / F.gelu, the fallback; identical in the AVX-512, AVX2 and scalar builds).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"act_mul: unknown activation {activation!r} (expected {', '.join(ACTIVATIONS)})")
    lib = _select(impl)
    if lib is None:
        g = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
        return g * up
    if not (gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype == torch.float32
            and gate.device.type == "cpu" and up.device.type == "cpu"):
        raise ValueError(f"act_mul: gate and up must be float32 CPU [T, N] tensors of one shape, got "
                         f"{gate.dtype} {tuple(gate.shape)} and {up.dtype} {tuple(up.shape)}")
    T, N = gate.shape
    gate = gate if gate.stride(1) == 1 and gate.stride(0) >= N else gate.contiguous()
    up = up if up.stride(1) == 1 and up.stride(0) >= N else up.contiguous()
    out = torch.empty(T, N, dtype=torch.float32)
    if T and N:
        _check(lib.ss_act_mul(gate.data_ptr(), up.data_ptr(), T, N, gate.stride(0), up.stride(0),
                              ACTIVATIONS[activation], out.data_ptr(), N, get_num_threads()), "act_mul")
    return out


# --------------------------------------------------------------------------
# argmax
# --------------------------------------------------------------------------

def argmax_rows(x: torch.Tensor, *, impl: str | None = None) -> list[int]:
    """Each row's argmax as torch.argmax(x, -1) gives it (the first of the largest; a NaN counts as
    the largest), x [M, N]: greedy decoding's token. In C (one vector pass a row) for float32 rows
    on the CPU, where torch's argmax over a 150-250K vocabulary takes a fifth of a millisecond."""
    lib = _select(impl) if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 else None
    if lib is None or x.shape[1] == 0 or x.stride(1) != 1:
        return x.argmax(dim=-1).tolist()
    m, n = x.shape
    out = torch.empty(m, dtype=torch.int64)
    _check(lib.ss_argmax_rows(x.data_ptr(), m, n, x.stride(0) if m > 1 else n, out.data_ptr()), "argmax_rows")
    return out.tolist()
