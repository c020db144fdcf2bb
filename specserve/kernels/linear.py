"""Weight formats (fp32, int8 per channel, GGUF blocks) and the batch-invariant linear layer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .hostmem import anon_bytes
from .library import (
    _ACT_AMIN,
    _FMT_PANEL,
    _FMT_F32,
    _FMT_I8,
    ACT_BLOCK,
    DEQUANT_QTYPES,
    GGUF_QTYPES,
    _check,
    _check_2d_float,
    _get_lib,
    _is_torch,
    _require,
    _select,
    get_num_threads,
    torch_one_thread,
)


class F32Weight:
    """Plain fp32 weight [N, K] (row-major, contiguous)."""

    __slots__ = ("w",)
    fmt = _FMT_F32

    def __init__(self, w: torch.Tensor):
        _check_2d_float(w, "F32Weight.w")
        _require(w.is_contiguous(), "F32Weight.w must be contiguous")
        self.w = w

    @classmethod
    def from_float(cls, w: torch.Tensor) -> F32Weight:
        return cls(w.detach().to(device="cpu", dtype=torch.float32).contiguous())

    @property
    def n(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.w.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.w.numel() * 4

    def dequantize(self) -> torch.Tensor:
        return self.w

    act_block = None  # activations always stay fp32

    def rows(self, idx: torch.Tensor) -> F32Weight:
        """The weight of output channels idx [n'] int64 only."""
        return F32Weight(self.w[idx].contiguous())

    def _c_args(self) -> tuple[int, int, int, int]:
        return self.w.data_ptr(), _FMT_F32, self.w.shape[1] * 4, 0

    def __repr__(self) -> str:
        return f"F32Weight(n={self.n}, k={self.k})"


def _pack_panels(fmt: int, src: torch.Tensor, n: int, k: int, row_bytes: int) -> torch.Tensor | None:
    """src [n, row_bytes] in the file / int8 layout -> the kernels' panel layout, or None without
    the C library (the torch fallback reads the plain layout)."""
    lib = None if _is_torch(None) else _get_lib()  # the same layout in every build
    if lib is None:
        return None
    packed = anon_bytes(int(lib.ss_panel_bytes(fmt, n, k)))  # huge pages: the decode step streams it
    _check(lib.ss_panel_pack(fmt, src.data_ptr(), n, k, row_bytes, packed.data_ptr(), get_num_threads()),
           "panel pack")
    return packed


def _unpack_panels(fmt: int, packed: torch.Tensor, n: int, k: int, idx: torch.Tensor, row_bytes: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rows idx of a packed weight in the plain layout: [len(idx), row_bytes] bytes as dtype."""
    lib = _get_lib()  # packed by it (_pack_panels)
    idx = idx.to(torch.int64).contiguous()
    out = torch.empty(idx.numel(), row_bytes, dtype=torch.uint8)
    _check(lib.ss_panel_rows(fmt, packed.data_ptr(), n, k, idx.data_ptr(), idx.numel(), out.data_ptr()),
           "panel rows")
    return out.view(dtype)


def _plain_rows(plain: torch.Tensor | None, fmt: int, packed: torch.Tensor, n: int, k: int, idx: torch.Tensor,
                row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows idx in the plain layout, from the plain tensor when it is kept, else from the panels."""
    if plain is not None:
        return plain[idx].contiguous()
    return _unpack_panels(fmt, packed, n, k, idx, row_bytes, dtype)


class Int8Weight:
    """Symmetric per-output-channel int8: w[n, k] ~= q[n, k] * scale[n].

    The kernel computes (sum_k x[k] * q[n, k]) * scale[n] (+ bias); with
    ``int_dot`` (default) and K % 32 == 0, x is quantized to int8 first (see
    the module docstring) and q is kept in the kernels' panel layout
    (``packed``; ``q`` rebuilds the plain [N, K] from it), else x stays fp32."""

    __slots__ = ("_q", "packed", "scale", "n", "k", "int_dot", "_fallback")
    fmt = _FMT_I8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, *, int_dot: bool = True):
        _require(isinstance(q, torch.Tensor) and q.dim() == 2 and q.dtype == torch.int8,
                 f"Int8Weight.q must be an int8 [N, K] tensor, got {getattr(q, 'dtype', type(q))} "
                 f"{tuple(getattr(q, 'shape', ()))}")
        _require(q.is_contiguous() and q.device.type == "cpu", "Int8Weight.q must be a contiguous CPU tensor")
        _require(isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
                 and tuple(scale.shape) == (q.shape[0],) and scale.is_contiguous(),
                 f"Int8Weight.scale must be a contiguous float32 [{q.shape[0]}] tensor")
        self._q: torch.Tensor | None = q
        self.n, self.k = int(q.shape[0]), int(q.shape[1])
        self.scale = scale
        self.int_dot = bool(int_dot)
        self._fallback: torch.Tensor | None = None
        self.packed = _pack_panels(_FMT_I8, q, self.n, self.k, self.k) if self.act_block else None
        if self.packed is not None:
            self._q = None

    @classmethod
    def from_float(cls, w: torch.Tensor, *, int_dot: bool = True) -> Int8Weight:
        w = w.detach().to(device="cpu", dtype=torch.float32)
        _check_2d_float(w, "weight")
        absmax = w.abs().amax(dim=1)
        scale = absmax / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        return cls(q, scale.contiguous(), int_dot=int_dot)

    @property
    def q(self) -> torch.Tensor:
        """int8 [N, K] (rebuilt from the panels when packed)."""
        if self._q is not None:
            return self._q
        return _unpack_panels(_FMT_I8, self.packed, self.n, self.k, torch.arange(self.n), self.k, torch.int8)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return (self.packed if self.packed is not None else self._q).numel() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    @property
    def act_block(self) -> int | None:
        """Activation block of the integer-dot path, or None when x stays fp32."""
        return 32 if self.int_dot and self.k % 32 == 0 else None

    def rows(self, idx: torch.Tensor) -> Int8Weight:
        """The weight of output channels idx [n'] int64 only."""
        q = _plain_rows(self._q, _FMT_I8, self.packed, self.n, self.k, idx, self.k, torch.int8)
        return Int8Weight(q, self.scale[idx].contiguous(), int_dot=self.int_dot)

    def _c_args(self) -> tuple[int, int, int, int]:
        if self.packed is not None and self.act_block:
            return self.packed.data_ptr(), _FMT_I8 | _FMT_PANEL, self.k, self.scale.data_ptr()
        if self._q is None:  # packed, and int_dot switched off: the fp32 path reads the plain layout
            self._q = self.q
        return self._q.data_ptr(), _FMT_I8, self.k, self.scale.data_ptr()

    def __repr__(self) -> str:
        return f"Int8Weight(n={self.n}, k={self.k})"


def _qtype_name(qtype: Any) -> str:
    if isinstance(qtype, str):
        name = qtype.upper()
    elif hasattr(qtype, "name"):  # gguf.GGMLQuantizationType
        name = str(qtype.name).upper()
    elif isinstance(qtype, int):
        import gguf

        name = gguf.GGMLQuantizationType(qtype).name
    else:
        raise ValueError(f"unsupported qtype {qtype!r}")
    if name not in GGUF_QTYPES:
        raise ValueError(f"unsupported GGUF qtype {name!r}; supported: {', '.join(GGUF_QTYPES)}")
    return name


def dequantize_blocks(raw: torch.Tensor, qtype: str, n: int, k: int, *, impl: str | None = None) -> torch.Tensor:
    """fp32 [n, k] from GGUF blocks of a DEQUANT_QTYPES type (uint8 [n, row_bytes], contiguous):
    the C kernels' dequantizer, or gguf-py's under the torch fallback; the same bits either way."""
    _require(qtype in DEQUANT_QTYPES, f"no dequantizer for GGUF type {qtype!r}")
    fmt, be, bb = DEQUANT_QTYPES[qtype]
    _require(k % be == 0 and tuple(raw.shape) == (n, k // be * bb) and raw.dtype == torch.uint8
             and raw.is_contiguous(), f"{qtype} [{n}, {k}]: bad raw blocks {tuple(raw.shape)} {raw.dtype}")
    lib = _select(impl)
    if lib is None:
        import gguf

        arr = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype])
        return torch.from_numpy(arr.reshape(n, k).astype("float32", copy=False))
    out = torch.empty(n, k, dtype=torch.float32)
    _check(lib.ss_dequantize(fmt, raw.data_ptr(), n, k, k // be * bb, out.data_ptr(), get_num_threads()),
           "dequantize")
    return out


class GGUFBlockWeight:
    """A GGUF block-quantized weight.

    raw: uint8 [N, bytes_per_row] in the file's layout; each row is K / block_size blocks.
    int_dot (default True): multiply with int8-quantized activations in integer arithmetic (see
    the module docstring); False: dequantize and multiply fp32 activations.

    With int_dot, the weight is repacked at construction into the C kernels'
    panel layout (``packed``, 16 channels' blocks side by side, csrc/panel_pack.c) and the file
    layout is dropped; ``raw``, ``rows`` and ``dequantize`` rebuild file-layout blocks from it
    (the packing is a bijection on the bytes)."""

    __slots__ = ("_raw", "packed", "qtype", "n", "k", "int_dot", "_fallback")

    def __init__(self, raw: torch.Tensor, qtype: Any, n: int, k: int, *, int_dot: bool = True):
        name = _qtype_name(qtype)
        _, be, bb = GGUF_QTYPES[name]
        _require(n > 0 and k > 0, f"bad shape n={n}, k={k}")
        _require(k % be == 0, f"{name}: K={k} must be a multiple of the block size {be}")
        row_bytes = k // be * bb
        _require(isinstance(raw, torch.Tensor) and raw.dtype == torch.uint8,
                 f"raw must be a uint8 tensor, got {getattr(raw, 'dtype', type(raw))}")
        _require(tuple(raw.shape) == (n, row_bytes),
                 f"{name} [{n}, {k}] needs raw shape ({n}, {row_bytes}), got {tuple(raw.shape)}")
        _require(raw.is_contiguous() and raw.device.type == "cpu", "raw must be a contiguous CPU tensor")
        self._raw: torch.Tensor | None = raw
        self.packed: torch.Tensor | None = None
        self.qtype = name
        self.n = int(n)
        self.k = int(k)
        self.int_dot = bool(int_dot)
        self._fallback: torch.Tensor | None = None
        if self.int_dot:
            self.packed = _pack_panels(self.fmt, raw, self.n, self.k, self.row_bytes)
            if self.packed is not None:
                self._raw = None

    @property
    def raw(self) -> torch.Tensor:
        """uint8 [N, row_bytes] in the file's layout (rebuilt from the panels when packed)."""
        return self._raw if self._raw is not None else self._rows_raw(torch.arange(self.n))

    @classmethod
    def from_raw(cls, raw: Any, qtype: Any, n: int, k: int, *, int_dot: bool = True) -> GGUFBlockWeight:
        """raw: uint8 bytes of the tensor (torch or numpy, 1-D or 2-D)."""
        name = _qtype_name(qtype)
        _, be, bb = GGUF_QTYPES[name]
        _require(k % be == 0, f"{name}: K={k} must be a multiple of the block size {be}")
        if not isinstance(raw, torch.Tensor):
            import numpy as np

            raw = torch.from_numpy(np.ascontiguousarray(np.asarray(raw)).view(np.uint8))
        _require(raw.dtype == torch.uint8, f"raw must be uint8, got {raw.dtype}")
        row_bytes = k // be * bb
        _require(raw.numel() == n * row_bytes,
                 f"{name} [{n}, {k}] needs {n * row_bytes} bytes, got {raw.numel()}")
        return cls(raw.reshape(n, row_bytes).contiguous(), name, n, k, int_dot=int_dot)

    @classmethod
    def from_float(cls, w: torch.Tensor, qtype: Any, *, int_dot: bool = True) -> GGUFBlockWeight:
        """Quantize with gguf-py's reference quantizer (Q8_0, Q4_0, Q4_1)."""
        import gguf
        import numpy as np

        name = _qtype_name(qtype)
        w = w.detach().to(device="cpu", dtype=torch.float32).contiguous()
        _check_2d_float(w, "weight")
        raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[name])
        return cls.from_raw(torch.from_numpy(np.ascontiguousarray(raw)), name, w.shape[0], w.shape[1],
                            int_dot=int_dot)

    @property
    def fmt(self) -> int:
        return GGUF_QTYPES[self.qtype][0]

    @property
    def row_bytes(self) -> int:
        _, be, bb = GGUF_QTYPES[self.qtype]
        return self.k // be * bb

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return (self.packed if self.packed is not None else self._raw).numel()

    def dequantize(self, *, impl: str | None = None) -> torch.Tensor:
        """fp32 [N, K]; bit-identical to gguf.quants.dequantize."""
        return dequantize_blocks(self.raw, self.qtype, self.n, self.k, impl=impl)

    @property
    def act_block(self) -> int | None:
        """Activation block of the integer-dot path, or None when x stays fp32."""
        return ACT_BLOCK[self.fmt] if self.int_dot else None

    def rows(self, idx: torch.Tensor) -> GGUFBlockWeight:
        """The weight of output channels idx [n'] int64 only (blocks copied as stored)."""
        return GGUFBlockWeight(self._rows_raw(idx), self.qtype, int(idx.numel()), self.k, int_dot=self.int_dot)

    def _rows_raw(self, idx: torch.Tensor) -> torch.Tensor:
        return _plain_rows(self._raw, self.fmt, self.packed, self.n, self.k, idx, self.row_bytes, torch.uint8)

    def dequantize_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """fp32 [n', K]: channels idx [n'] dequantized (an embedding lookup), nothing repacked."""
        return dequantize_blocks(self._rows_raw(idx), self.qtype, int(idx.numel()), self.k)

    def _c_args(self) -> tuple[int, int, int, int]:
        if self.packed is not None and self.int_dot:
            return self.packed.data_ptr(), self.fmt | _FMT_PANEL, self.row_bytes, 0
        if self._raw is None:  # packed, and int_dot switched off: the fp32 path reads the file layout
            self._raw = self.raw
        return self._raw.data_ptr(), self.fmt, self.row_bytes, 0

    def __repr__(self) -> str:
        return f"GGUFBlockWeight({self.qtype}, n={self.n}, k={self.k})"


Weight = F32Weight | Int8Weight | GGUFBlockWeight


# --------------------------------------------------------------------------
# linear
# --------------------------------------------------------------------------


def _as_weight(w: Any) -> Weight:
    if isinstance(w, (F32Weight, Int8Weight, GGUFBlockWeight)):
        return w
    if isinstance(w, torch.Tensor):
        return F32Weight(w)
    raise TypeError(f"unsupported weight type {type(w).__name__}")


def _fallback_weight(w: Weight) -> torch.Tensor:
    """fp32 matrix used by the torch fallback (cached on the weight object)."""
    if isinstance(w, F32Weight):
        return w.w
    if w._fallback is None:
        if isinstance(w, Int8Weight):
            w._fallback = w.q.float()
        else:
            w._fallback = w.dequantize(impl="torch")
    return w._fallback


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer-dot path's activation quantizer, in torch (the C kernel's, value for value).

    x: float32 [M, K], K % block == 0. Per block of ``block`` values:
    amax = max |x|, dx = amax / 127, q = round_half_even(x * (1 / dx)) in
    [-127, 127]; amax < 1e-30 gives dx = 0 and q = 0, a block holding Inf or
    NaN gives dx = NaN and q = 0. Returns (q int8 [M, K], dx float32
    [M, K / block]); x ~= q * dx with |error| <= amax / 254.
    """
    M, K = x.shape
    xb = x.reshape(M, K // block, block)
    amax = xb.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    tiny = amax < torch.tensor(_ACT_AMIN, dtype=torch.float32)
    d = torch.where(tiny, torch.zeros_like(amax), amax / 127.0)
    d = torch.where(finite, d, torch.full_like(amax, float("nan")))
    inv = torch.where(finite & ~tiny, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(torch.where(torch.isfinite(xb), xb, torch.zeros_like(xb)) * inv.unsqueeze(-1))
    return q.to(torch.int8).reshape(M, K), d


def linear(x: torch.Tensor, w: Any, bias: torch.Tensor | None = None, *, impl: str | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias), batch invariant.

    x: float32 [M, K] (or [..., K]); rows must be contiguous (a 2-D view with
    a row stride is accepted). w: F32Weight | Int8Weight | GGUFBlockWeight
    (a plain float32 [N, K] tensor is taken as F32Weight). Returns [M, N]
    (or [..., N]) float32. ``linear(x, w)[i]`` is bit-identical to
    ``linear(x[i:i+1], w)[0]`` for any M and any thread count. When
    ``w.act_block`` is set, x is quantized to int8 first (module docstring).
    """
    w = _as_weight(w)
    N, K = w.shape
    # cheap checks first; messages are only built on failure
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.dim() >= 1 and x.shape[-1] == K):
        if not isinstance(x, torch.Tensor):
            raise ValueError("linear: x must be a torch.Tensor")
        raise ValueError(f"linear: x must be a float32 CPU tensor [..., K] with K={K} (the weight's), "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= K:
        x2 = x
    elif x.is_contiguous():
        x2 = x.reshape(-1, K)
    else:
        raise ValueError(f"linear: x must be contiguous (shape {tuple(x.shape)}, strides {tuple(x.stride())})")
    M = x2.shape[0]
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.dtype == torch.float32
                                 and bias.dim() == 1 and bias.shape[0] == N and bias.is_contiguous()):
        raise ValueError(f"linear: bias must be a contiguous float32 [{N}] tensor")
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    elif not (out.dtype == torch.float32 and tuple(out.shape) == (M, N) and out.is_contiguous()):
        raise ValueError(f"linear: out must be a contiguous float32 [{M}, {N}] tensor")
    lib = _select(impl)
    block = w.act_block
    if lib is not None:
        if M > 0:
            wptr, fmt, row_bytes, sptr = w._c_args()
            fn = lib.ss_linear if block is None else lib.ss_linear_q8
            rc = fn(x2.data_ptr(), M, K, x2.stride(0), wptr, fmt, row_bytes, sptr,
                    bias.data_ptr() if bias is not None else None, out.data_ptr(), N, N, get_num_threads())
            if rc:
                _check(rc, "linear")
    else:
        wf = _fallback_weight(w)
        with torch.no_grad(), torch_one_thread():
            for i in range(M):
                xi = x2[i:i + 1]
                if block is not None:  # the same int8 activations as the C kernel
                    q, d = quantize_activations(xi, block)
                    xi = (q.float().reshape(1, K // block, block) * d.unsqueeze(-1)).reshape(1, K)
                r = F.linear(xi, wf)
                if isinstance(w, Int8Weight):
                    r = r * w.scale
                if bias is not None:
                    r = r + bias
                out[i:i + 1] = r
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], N)
