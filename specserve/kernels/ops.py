"""Batch-invariant CPU kernels (linear, paged attention, RMSNorm).

Every per-row result is bit-identical whatever the number of rows in the call
and whatever the thread count: each output element is reduced by one thread
in a fixed order (see ``csrc/cpu_kernels.c``). This is what lets speculative
decoding (verification of k draft tokens in one call) reproduce plain greedy
decoding token for token.

Linear layers with int8 or GGUF block weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)
use integer dot products by default, as llama.cpp does: each row of x is
quantized to int8 per block of 32 values (256 for Q4_K / Q6_K) with one fp32
scale per block, dx = max|x| / 127, q = round_half_even(x * (1 / dx)) (see
``quantize_activations``), and every weight block is multiplied with it in
exact int32 arithmetic; the float combination of the block results has a
fixed order per output (``csrc/linear_q8.h``), so batch invariance holds as
before. The price is the activation rounding, at most max|x_block| / 254 per
value, as in llama.cpp. Measured against fp32 activations: one layer's
outputs move by up to ~1% of max |y| (tests/test_kernels.py, outlier-heavy
x); end to end, the logits move by ~3% (relative L2) on smollm2-135m (32-value
blocks) and ~6% on qwen2.5-coder-1.5b, where the 256-value blocks of the
K-quants cost most (32-value blocks would give ~1.7% there, at the price of a
float multiply-add per 64 values instead of per 256). A weight built with
``int_dot=False`` (or an int8 weight whose K is not a multiple of 32) keeps
the fp32-activation path. The torch fallback quantizes the activations the
same way.

``rope`` and ``act_mul`` are the elementwise parts of a decoder layer in C
(``csrc/decoder.h``; rope gives the bits of the torch formula, act_mul is
within a few ulp of torch's silu / gelu), and ``decoder_layers`` runs a whole
stack of decoder layers in one call from descriptors (``SSLayer`` etc.; built
by ``specserve/models/fused.py``), chaining the same kernels as the per-op
path, so both give the same bits.

The C library is compiled on first use (``build.py``). Without a compiler a
pure-torch fallback is used: it processes one row (one query) per torch call,
so it is batch-invariant too, but slow. Force it with ``impl="torch"``, with
``set_default_impl("torch")`` or the environment variable
``SPECSERVE_KERNELS=torch`` (read on first use; ``SPECSERVE_KERNELS=c`` makes
a missing C library an error instead).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F

from . import build as _build

__all__ = [
    "F32Weight",
    "Int8Weight",
    "GGUFBlockWeight",
    "GGUF_QTYPES",
    "ACT_BLOCK",
    "quantize_activations",
    "linear",
    "paged_attention",
    "KV_FORMATS",
    "KV_INT4_GROUP",
    "kv_quantize",
    "kv_quantize_c",
    "kv_dequantize",
    "kv_row_bytes",
    "rms_norm",
    "add_rms_norm",
    "rope",
    "act_mul",
    "ACTIVATIONS",
    "decoder_library",
    "decoder_layers",
    "kernels_available",
    "kernels_info",
    "set_num_threads",
    "get_num_threads",
    "set_default_impl",
    "KernelError",
]


class KernelError(RuntimeError):
    pass


# format ids shared with the C file
_FMT_F32, _FMT_I8, _FMT_Q8_0, _FMT_Q4_0, _FMT_Q4_1, _FMT_Q4_K, _FMT_Q6_K = range(7)

# qtype -> (format id, elements per block, bytes per block)
GGUF_QTYPES: dict[str, tuple[int, int, int]] = {
    "Q8_0": (_FMT_Q8_0, 32, 34),
    "Q4_0": (_FMT_Q4_0, 32, 18),
    "Q4_1": (_FMT_Q4_1, 32, 20),
    "Q4_K": (_FMT_Q4_K, 256, 144),
    "Q6_K": (_FMT_Q6_K, 256, 210),
}

# activation block (values per fp32 scale) of the integer-dot path, per weight format
ACT_BLOCK: dict[int, int] = {_FMT_I8: 32, _FMT_Q8_0: 32, _FMT_Q4_0: 32, _FMT_Q4_1: 32, _FMT_Q4_K: 256, _FMT_Q6_K: 256}
_ACT_AMIN = 1e-30  # blocks with max |x| below this quantize to zero (keeps 1 / dx finite)

_ERRORS = {
    -1: (ValueError, "invalid arguments"),
    -2: (ValueError, "unknown weight format"),
    -3: (IndexError, "block table entry out of range of the kv cache"),
    -4: (IndexError, "position beyond the block table (or negative)"),
    -5: (IndexError, "seq id out of range of block_tables"),
    -6: (MemoryError, "out of memory in kernel"),
    -7: (IndexError, "position beyond the rope table (or negative)"),
    -8: (IndexError, "kv slot out of range of the kv cache"),
}

# --------------------------------------------------------------------------
# library loading / dispatch
# --------------------------------------------------------------------------

_lib_lock = threading.Lock()
_lib_cache: dict[str, ctypes.CDLL | None] = {}
_num_threads_override: int | None = None

_vp, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.set_num_threads.argtypes = [_i32]
    lib.set_num_threads.restype = None
    for name in ("ss_get_max_threads", "ss_abi_version", "ss_has_avx2", "ss_has_avx512", "ss_has_openmp",
                 "ss_has_f16c", "ss_int_dot_isa"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = _i32
    lib.ss_dequantize.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _i32]
    lib.ss_dequantize.restype = _i32
    lib.ss_linear.argtypes = [_vp, _i64, _i64, _i64, _vp, _i32, _i64, _vp, _vp, _vp, _i64, _i64, _i32]
    lib.ss_linear.restype = _i32
    lib.ss_linear_q8.argtypes = lib.ss_linear.argtypes
    lib.ss_linear_q8.restype = _i32
    lib.ss_quantize_act.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _vp]
    lib.ss_quantize_act.restype = _i32
    lib.ss_paged_attention.argtypes = [_vp, _vp, _vp, _i64, _i64, _i64, _vp, _i64, _i64, _vp, _vp,
                                       _i64, _i64, _i64, _f32, _i64, _f32, _vp, _i32]
    lib.ss_paged_attention.restype = _i32
    lib.ss_paged_attention_kv.argtypes = [_i32, _vp, _vp, _vp, _vp, _vp, _i64, _i64, _i64, _i64, _vp, _i64, _i64,
                                          _vp, _vp, _i64, _i64, _i64, _f32, _i64, _f32, _vp, _i32]
    lib.ss_paged_attention_kv.restype = _i32
    lib.ss_kv_quantize.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _vp]
    lib.ss_kv_quantize.restype = _i32
    lib.ss_fp8_e4m3_to_float.argtypes = [_i32]
    lib.ss_fp8_e4m3_to_float.restype = _f32
    lib.ss_rms_norm.argtypes = [_vp, _i64, _i64, _i64, _vp, _f32, _i32, _vp, _i64, _i32]
    lib.ss_rms_norm.restype = _i32
    lib.ss_add_rms_norm.argtypes = [_vp, _vp, _i64, _i64, _vp, _f32, _i32, _vp, _vp, _i32]
    lib.ss_add_rms_norm.restype = _i32
    lib.ss_rope.argtypes = [_vp, _i64, _i64, _i64, _i64, _vp, _vp, _vp, _i64, _vp, _i64, _i32]
    lib.ss_rope.restype = _i32
    lib.ss_act_mul.argtypes = [_vp, _vp, _i64, _i64, _i64, _i64, _i32, _vp, _i64, _i32]
    lib.ss_act_mul.restype = _i32
    lib.ss_decoder_layers.argtypes = [_vp, _vp, _vp, _i64, _i64, _vp, _vp, _vp, _i32]
    lib.ss_decoder_layers.restype = _i32
    return lib


def _get_lib(variant: str = "native") -> ctypes.CDLL | None:
    lib = _lib_cache.get(variant, False)
    if lib is not False:
        return lib  # type: ignore[return-value]
    with _lib_lock:
        if variant not in _lib_cache:
            lib = _build.load_library(variant)
            _lib_cache[variant] = _declare(lib) if lib is not None else None
        return _lib_cache[variant]


def kernels_available() -> bool:
    """True when the compiled C kernels can be used (builds them on first call)."""
    return _get_lib() is not None


_default_impl: str | None = None  # None: read SPECSERVE_KERNELS on next use


def set_default_impl(impl: str | None) -> None:
    """Implementation used when a call passes no ``impl``: "auto" (C when
    available), "c" (C or error) or "torch" (fallback). None re-reads the
    SPECSERVE_KERNELS environment variable (it is read once, on first use)."""
    global _default_impl
    if impl is not None:
        _select(impl)  # validate
    _default_impl = impl.lower() if impl is not None else None


def _select(impl: str | None) -> ctypes.CDLL | None:
    """The C library to use, or None for the torch fallback."""
    global _default_impl
    if impl is None:
        if _default_impl is None:
            _default_impl = (os.environ.get("SPECSERVE_KERNELS", "auto") or "auto").lower()
        impl = _default_impl
    impl = impl.lower()
    if impl in ("torch", "fallback", "python"):
        return None
    if impl in ("auto", ""):
        return _get_lib()
    if impl == "c":
        lib = _get_lib()
        if lib is None:
            raise KernelError(f"C kernels requested but unavailable: {_build.get_build().error}")
        return lib
    if impl in ("c-scalar", "c-avx2"):  # test builds with SIMD paths compiled out
        variant = impl[2:]
        lib = _get_lib(variant)
        if lib is None:
            raise KernelError(f"{variant} C kernels unavailable: {_build.get_build(variant).error}")
        return lib
    raise ValueError(f"unknown kernel implementation {impl!r} (expected auto, c, torch)")


def set_num_threads(n: int | None) -> None:
    """Threads used by the C kernels; None (default) = torch.get_num_threads().

    The count is passed to every kernel call (OpenMP ``num_threads``), so it
    does not touch torch's own setting. Results never depend on it."""
    global _num_threads_override
    if n is not None and n < 1:
        raise ValueError("thread count must be >= 1")
    _num_threads_override = int(n) if n is not None else None


def get_num_threads() -> int:
    return _num_threads_override if _num_threads_override is not None else torch.get_num_threads()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        exc, msg = _ERRORS.get(rc, (KernelError, f"error {rc}"))
        raise exc(f"{what}: {msg}")


def kernels_info() -> dict[str, Any]:
    res = _build.get_build()
    lib = res.lib
    info: dict[str, Any] = {
        "available": lib is not None,
        "library": res.path,
        "flags": list(res.flags),
        "compiler": res.compiler,
        "compiler_version": (res.compiler_version or "").splitlines()[0] if res.compiler_version else None,
        "error": res.error,
        "impl_env": os.environ.get("SPECSERVE_KERNELS", "auto"),
        "default_impl": _default_impl or "auto",
        "num_threads": get_num_threads(),
    }
    if lib is not None:
        lib = _get_lib()
        info.update(
            avx2=bool(lib.ss_has_avx2()),
            avx512=bool(lib.ss_has_avx512()),
            f16c=bool(lib.ss_has_f16c()),
            openmp=bool(lib.ss_has_openmp()),
            abi_version=int(lib.ss_abi_version()),
            int_dot=("scalar", "avx2", "avx-vnni", "avx512", "avx512-vnni")[int(lib.ss_int_dot_isa())],
            omp_max_threads=int(lib.ss_get_max_threads()),
        )
    else:
        info.update(avx2=False, avx512=False, f16c=False, openmp=False)
    return info


# --------------------------------------------------------------------------
# weight containers
# --------------------------------------------------------------------------


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_2d_float(w: torch.Tensor, name: str) -> None:
    _require(isinstance(w, torch.Tensor), f"{name} must be a torch.Tensor, got {type(w).__name__}")
    _require(w.dim() == 2, f"{name} must be 2-D [N, K], got shape {tuple(w.shape)}")
    _require(w.dtype == torch.float32, f"{name} must be float32, got {w.dtype}")
    _require(w.device.type == "cpu", f"{name} must be on the CPU, got {w.device}")


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


class Int8Weight:
    """Symmetric per-output-channel int8: w[n, k] ~= q[n, k] * scale[n].

    The kernel computes (sum_k x[k] * q[n, k]) * scale[n] (+ bias); with
    ``int_dot`` (default) and K % 32 == 0, x is quantized to int8 first (see
    the module docstring), else x stays fp32."""

    __slots__ = ("q", "scale", "int_dot", "_fallback")
    fmt = _FMT_I8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, *, int_dot: bool = True):
        _require(isinstance(q, torch.Tensor) and q.dim() == 2 and q.dtype == torch.int8,
                 f"Int8Weight.q must be an int8 [N, K] tensor, got {getattr(q, 'dtype', type(q))} "
                 f"{tuple(getattr(q, 'shape', ()))}")
        _require(q.is_contiguous() and q.device.type == "cpu", "Int8Weight.q must be a contiguous CPU tensor")
        _require(isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
                 and tuple(scale.shape) == (q.shape[0],) and scale.is_contiguous(),
                 f"Int8Weight.scale must be a contiguous float32 [{q.shape[0]}] tensor")
        self.q = q
        self.scale = scale
        self.int_dot = bool(int_dot)
        self._fallback: torch.Tensor | None = None

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
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    @property
    def act_block(self) -> int | None:
        """Activation block of the integer-dot path, or None when x stays fp32."""
        return 32 if self.int_dot and self.k % 32 == 0 else None

    def rows(self, idx: torch.Tensor) -> Int8Weight:
        """The weight of output channels idx [n'] int64 only."""
        return Int8Weight(self.q[idx].contiguous(), self.scale[idx].contiguous(), int_dot=self.int_dot)

    def _c_args(self) -> tuple[int, int, int, int]:
        return self.q.data_ptr(), _FMT_I8, self.q.shape[1], self.scale.data_ptr()

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


class GGUFBlockWeight:
    """A GGUF block-quantized weight kept in the file's raw byte layout.

    raw: uint8 [N, bytes_per_row]; each row is K / block_size blocks.
    int_dot (default True): multiply with int8-quantized activations in
    integer arithmetic (see the module docstring); False: dequantize and
    multiply fp32 activations."""

    __slots__ = ("raw", "qtype", "n", "k", "int_dot", "_fallback")

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
        self.raw = raw
        self.qtype = name
        self.n = int(n)
        self.k = int(k)
        self.int_dot = bool(int_dot)
        self._fallback: torch.Tensor | None = None

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
        return self.raw.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self, *, impl: str | None = None) -> torch.Tensor:
        """fp32 [N, K]; bit-identical to gguf.quants.dequantize."""
        lib = _select(impl)
        if lib is None:
            import gguf

            arr = gguf.quants.dequantize(self.raw.numpy(), gguf.GGMLQuantizationType[self.qtype])
            return torch.from_numpy(arr.reshape(self.n, self.k).astype("float32", copy=False))
        out = torch.empty(self.n, self.k, dtype=torch.float32)
        _check(lib.ss_dequantize(self.fmt, self.raw.data_ptr(), self.n, self.k, self.row_bytes,
                                 out.data_ptr(), get_num_threads()), "dequantize")
        return out

    @property
    def act_block(self) -> int | None:
        """Activation block of the integer-dot path, or None when x stays fp32."""
        return ACT_BLOCK[self.fmt] if self.int_dot else None

    def rows(self, idx: torch.Tensor) -> GGUFBlockWeight:
        """The weight of output channels idx [n'] int64 only (blocks copied as stored)."""
        return GGUFBlockWeight(self.raw[idx].contiguous(), self.qtype, int(idx.numel()), self.k, int_dot=self.int_dot)

    def _c_args(self) -> tuple[int, int, int, int]:
        return self.raw.data_ptr(), GGUF_QTYPES[self.qtype][0], self.raw.shape[1], 0

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
        with torch.no_grad():
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


# --------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------


def _check_i32_1d(t: torch.Tensor, name: str, n: int) -> None:
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1 and t.shape[0] == n
            and t.is_contiguous() and t.device.type == "cpu"):
        raise ValueError(f"paged_attention: {name} must be a contiguous int32 CPU tensor of shape ({n},), "
                         f"got {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


# KV cache formats: name -> (C format id, storage dtype). Per (slot, kv head) row of D values:
#   fp32 / bf16 / fp16: D values of that dtype (bf16/fp16: round to nearest even on write).
#   fp8_e4m3: D e4m3fn bytes (uint8 storage) + one fp32 scale = absmax / 448: x ~= fp8 * scale.
#   int8: D int8 + one fp32 scale = absmax / 127 (symmetric): x ~= q * scale.
#   int4: D / 2 bytes (element 2i in the low nibble of byte i, 2i+1 in the high one), asymmetric
#         per group of KV_INT4_GROUP values along head_dim with fp32 (scale, min):
#         scale = (max - min) / 15, q = round((x - min) / scale) in [0, 15], x ~= q * scale + min.
# Quantization (kv_quantize) is elementwise given per-row / per-group max and min, which are exact
# whatever the reduction order, so a token's stored bytes depend on its K/V values only.
KV_FORMATS: dict[str, tuple[int, torch.dtype]] = {
    "fp32": (0, torch.float32),
    "bf16": (1, torch.bfloat16),
    "fp16": (2, torch.float16),
    "fp8_e4m3": (3, torch.uint8),
    "int8": (4, torch.int8),
    "int4": (5, torch.uint8),
}
KV_INT4_GROUP = 32
FP8_E4M3_MAX = 448.0


def _kv_format(kv_dtype: str) -> tuple[int, torch.dtype]:
    try:
        return KV_FORMATS[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r} (expected one of {', '.join(KV_FORMATS)})") from None


def kv_int4_group(head_dim: int) -> int:
    """int4 group size along head_dim: 32, or the whole (even) head when 32 does not divide it."""
    if head_dim % 2:
        raise ValueError(f"int4 KV cache needs an even head_dim, got {head_dim}")
    return KV_INT4_GROUP if head_dim % KV_INT4_GROUP == 0 else head_dim


def kv_c_group(kv_dtype: str, head_dim: int) -> int:
    """The group argument of the C KV kernels: int4's group size, 0 for the other formats."""
    return kv_int4_group(head_dim) if kv_dtype == "int4" else 0


def kv_scale_shape(kv_dtype: str, head_dim: int) -> tuple[int, ...] | None:
    """Trailing shape of the scale pool per (slot, kv head): () for fp8/int8, (groups, 2) for int4,
    None for unscaled formats."""
    if kv_dtype in ("fp8_e4m3", "int8"):
        return ()
    if kv_dtype == "int4":
        return (head_dim // kv_int4_group(head_dim), 2)
    _kv_format(kv_dtype)
    return None


def kv_store_dim(kv_dtype: str, head_dim: int) -> int:
    """Last dimension of the K/V pools (head_dim, or head_dim / 2 bytes for int4)."""
    return head_dim // 2 if kv_dtype == "int4" else head_dim


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Exact bytes one (token, kv head) row of K (or of V) takes, scales included."""
    _, dt = _kv_format(kv_dtype)
    elem = torch.tensor([], dtype=dt).element_size()
    n = kv_store_dim(kv_dtype, head_dim) * elem
    ss = kv_scale_shape(kv_dtype, head_dim)
    if ss is not None:
        cnt = 1
        for x in ss:
            cnt *= x
        n += 4 * cnt
    return n


def kv_quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] (float) -> (data in the storage dtype, scales float32 or None). See KV_FORMATS."""
    _, dt = _kv_format(kv_dtype)
    if kv_dtype in ("fp32", "bf16", "fp16"):
        return x.to(dt).contiguous(), None
    x = x.float()
    if kv_dtype in ("int8", "fp8_e4m3"):
        qmax = 127.0 if kv_dtype == "int8" else FP8_E4M3_MAX
        s = x.abs().amax(dim=-1) / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        y = x / s.unsqueeze(-1)
        if kv_dtype == "int8":
            data = torch.round(y).clamp_(-127, 127).to(torch.int8)
        else:
            data = y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return data.contiguous(), s.contiguous()
    # int4
    D = x.shape[-1]
    G = kv_int4_group(D)
    xg = x.reshape(*x.shape[:-1], D // G, G)
    mn = xg.amin(dim=-1)
    s = (xg.amax(dim=-1) - mn) / 15.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((xg - mn.unsqueeze(-1)) / s.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(*x.shape[:-1], D)
    data = q[..., 0::2] | (q[..., 1::2] << 4)
    return data.contiguous(), torch.stack((s, mn), dim=-1).contiguous()


def kv_quantize_c(x: torch.Tensor, kv_dtype: str, impl: str | None = "c") -> tuple[torch.Tensor, torch.Tensor | None]:
    """kv_quantize done by the C kernels (what the fused decoder path writes into the cache):
    x [N, D] float32 -> the same (data, scales) bits for finite inputs."""
    lib = _select(impl)
    if lib is None:
        raise KernelError("kv_quantize_c: the C kernels are not available")
    fmt, dt = _kv_format(kv_dtype)
    x = x.float().contiguous()
    n, d = x.shape
    data = torch.empty(n, kv_store_dim(kv_dtype, d), dtype=dt)
    sshape = kv_scale_shape(kv_dtype, d)
    scales = None if sshape is None else torch.empty(n, *sshape, dtype=torch.float32)
    _check(lib.ss_kv_quantize(fmt, x.data_ptr(), n, d, kv_c_group(kv_dtype, d), data.data_ptr(),
                              None if scales is None else scales.data_ptr()), "kv_quantize_c")
    return data, scales


def kv_dequantize(data: torch.Tensor, scales: torch.Tensor | None, kv_dtype: str) -> torch.Tensor:
    """Inverse of kv_quantize: float32 [..., D]; the same arithmetic as the C kernel's reads."""
    _kv_format(kv_dtype)
    if kv_dtype in ("fp32", "bf16", "fp16"):
        return data.float()
    if kv_dtype == "int8":
        return data.float() * scales.unsqueeze(-1)
    if kv_dtype == "fp8_e4m3":
        return data.view(torch.float8_e4m3fn).float() * scales.unsqueeze(-1)
    lo, hi = data & 15, data >> 4
    D = data.shape[-1] * 2
    G = kv_int4_group(D)
    q = torch.stack((lo, hi), dim=-1).reshape(*data.shape[:-1], D // G, G).float()
    out = q * scales[..., 0].unsqueeze(-1) + scales[..., 1].unsqueeze(-1)
    return out.reshape(*data.shape[:-1], D)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_ids: torch.Tensor, positions: torch.Tensor, scale: float, sliding_window: int = 0,
                    softcap: float = 0.0, *, kv_dtype: str = "fp32", k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """Causal attention of T queries over a paged KV cache.

    q [T, Hq, D] f32; k_cache / v_cache [num_blocks, block_size, Hkv, D] f32;
    block_tables [S, max_blocks] int32; seq_ids [T] int32 (row of
    block_tables); positions [T] int32 (the query attends to keys 0..pos of
    its sequence; key p lives in block block_tables[s][p // block_size] at
    offset p % block_size). GQA: head h uses kv head h // (Hq // Hkv).
    sliding_window > 0 keeps keys with pos - key_pos < window. softcap > 0
    applies softcap * tanh(score / softcap). Returns [T, Hq, D] f32; each
    query's result is bit-identical however the queries are batched.

    kv_dtype != "fp32": the caches hold that format (see KV_FORMATS; int4's
    last dim is D / 2) and k_scales / v_scales its scale pools
    ([num_blocks, block_size, Hkv] for fp8_e4m3 / int8, [..., Hkv, D / 32, 2]
    for int4). Rows are dequantized while read; the result is bit-identical
    to the fp32 kernel over kv_dequantize(cache) (still batch invariant).
    """
    if not (isinstance(q, torch.Tensor) and q.dim() == 3):
        raise ValueError("paged_attention: q must be a [T, Hq, D] tensor")
    T, Hq, D = q.shape
    fmt, store = _kv_format(kv_dtype)
    if kv_dtype == "fp8_e4m3":  # a float8_e4m3fn pool is read as its bytes
        if isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float8_e4m3fn:
            k_cache = k_cache.view(torch.uint8)
        if isinstance(v_cache, torch.Tensor) and v_cache.dtype == torch.float8_e4m3fn:
            v_cache = v_cache.view(torch.uint8)
    for name, t, dt in (("q", q, torch.float32), ("k_cache", k_cache, store), ("v_cache", v_cache, store)):
        if not (isinstance(t, torch.Tensor) and t.dtype == dt and t.is_contiguous()
                and t.device.type == "cpu"):
            raise ValueError(f"paged_attention: {name} must be a contiguous {str(dt).removeprefix('torch.')} "
                             f"CPU tensor")
    if k_cache.dim() != 4:
        raise ValueError(f"paged_attention: k_cache must be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError("paged_attention: v_cache must have the shape of k_cache")
    NB, BS, Hkv, Dk = k_cache.shape
    if (Dk * 2 if kv_dtype == "int4" else Dk) != D:
        raise ValueError(f"paged_attention: head dim of q ({D}) != cache ({Dk})")
    if not (Hkv > 0 and Hq % Hkv == 0):
        raise ValueError(f"paged_attention: Hq={Hq} must be a multiple of Hkv={Hkv}")
    sshape = kv_scale_shape(kv_dtype, D)
    if sshape is not None:
        want = (NB, BS, Hkv, *sshape)
        for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == want
                    and t.is_contiguous() and t.device.type == "cpu"):
                raise ValueError(f"paged_attention: {kv_dtype} needs {name}, a contiguous float32 CPU tensor "
                                 f"of shape {want}")
    if not (isinstance(block_tables, torch.Tensor) and block_tables.dtype == torch.int32
            and block_tables.dim() == 2 and block_tables.is_contiguous()):
        raise ValueError("paged_attention: block_tables must be a contiguous int32 [S, max_blocks] tensor")
    _check_i32_1d(seq_ids, "seq_ids", T)
    _check_i32_1d(positions, "positions", T)
    if D > 1024:
        raise ValueError("paged_attention: head dim > 1024 not supported")
    window = int(sliding_window or 0)
    cap = float(softcap or 0.0)
    if window < 0 or cap < 0.0:
        raise ValueError("paged_attention: sliding_window and softcap must be >= 0")
    out = torch.empty(T, Hq, D, dtype=torch.float32)
    if T == 0:
        return out
    S, MAXB = block_tables.shape
    lib = _select(impl)
    if lib is not None:
        if fmt == 0:
            rc = lib.ss_paged_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), NB, BS, Hkv,
                                        block_tables.data_ptr(), S, MAXB, seq_ids.data_ptr(), positions.data_ptr(),
                                        T, Hq, D, float(scale), window, cap, out.data_ptr(), get_num_threads())
        else:
            rc = lib.ss_paged_attention_kv(fmt, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                           k_scales.data_ptr() if sshape is not None else None,
                                           v_scales.data_ptr() if sshape is not None else None,
                                           kv_c_group(kv_dtype, D),
                                           NB, BS, Hkv, block_tables.data_ptr(), S, MAXB, seq_ids.data_ptr(),
                                           positions.data_ptr(), T, Hq, D, float(scale), window, cap,
                                           out.data_ptr(), get_num_threads())
        _check(rc, "paged_attention")
        return out
    # torch fallback: one query per torch call (batch invariant by construction)
    group = Hq // Hkv
    sid = seq_ids.tolist()
    pos_l = positions.tolist()
    with torch.no_grad():
        for t in range(T):
            s, pos = sid[t], pos_l[t]
            if not 0 <= s < S:
                raise IndexError(f"paged_attention: seq id {s} out of range of block_tables")
            if pos < 0 or pos // BS >= MAXB:
                raise IndexError(f"paged_attention: position {pos} beyond the block table")
            start = max(0, pos - window + 1) if window > 0 else 0
            p = torch.arange(start, pos + 1)
            blocks = block_tables[s].long()[p // BS]
            if bool((blocks < 0).any()) or bool((blocks >= NB).any()):
                raise IndexError("paged_attention: block table entry out of range of the kv cache")
            offs = p % BS
            k = k_cache[blocks, offs]  # [L, Hkv, D]
            v = v_cache[blocks, offs]
            if fmt != 0:
                k = kv_dequantize(k, None if sshape is None else k_scales[blocks, offs], kv_dtype)
                v = kv_dequantize(v, None if sshape is None else v_scales[blocks, offs], kv_dtype)
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[t], k) * scale
            if cap > 0.0:
                scores = torch.tanh(scores / cap) * cap
            probs = torch.softmax(scores, dim=-1)
            out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out


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
# a stack of decoder layers in one call (csrc/decoder.h)
# --------------------------------------------------------------------------


class SSLin(ctypes.Structure):
    """One linear layer's weight; n == 0: absent."""

    _fields_ = [("w", _vp), ("scale", _vp), ("bias", _vp), ("n", _i64), ("row_bytes", _i64),
                ("fmt", ctypes.c_int32), ("int_dot", ctypes.c_int32)]


# SSLayer.lin slots
LIN_SLOTS = ("q", "k", "v", "o", "gate", "up", "down")


class SSLayer(ctypes.Structure):
    """One decoder layer: lin[0] is the fused q|k|v weight when lin[1].n == 0, lin[4] the fused
    gate|up weight when lin[5].n == 0; q_norm / k_norm are NULL without qk-norm."""

    _fields_ = [("lin", SSLin * len(LIN_SLOTS)), ("attn_norm", _vp), ("ffn_norm", _vp), ("q_norm", _vp),
                ("k_norm", _vp), ("window", _i64)]


class SSKVPool(ctypes.Structure):
    """One layer's K / V pools [num_blocks, block_size, Hkv, D] in a KV_FORMATS format, with their
    scale pools (None for the unscaled formats) and the int4 group."""

    _fields_ = [("k", _vp), ("v", _vp), ("k_scales", _vp), ("v_scales", _vp), ("num_blocks", _i64),
                ("block_size", _i64), ("fmt", ctypes.c_int32), ("group", ctypes.c_int32)]


class SSModel(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("n_heads", _i64), ("n_kv_heads", _i64), ("head_dim", _i64), ("inter", _i64),
                ("eps", _f32), ("scale", _f32), ("softcap", _f32), ("act", ctypes.c_int32),
                ("rope_cos", _vp), ("rope_sin", _vp), ("rope_max_pos", _i64)]


class SSRows(ctypes.Structure):
    _fields_ = [("T", _i64), ("positions", _vp), ("seq_ids", _vp), ("slots", _vp), ("block_tables", _vp),
                ("S", _i64), ("max_blocks", _i64)]


def lin_struct(w: Weight, bias: torch.Tensor | None) -> SSLin:
    """The SSLin of one weight, with the kernel ops.linear would choose (integer dot or fp32)."""
    w = _as_weight(w)
    wptr, fmt, row_bytes, sptr = w._c_args()
    if bias is not None and not (bias.dtype == torch.float32 and bias.shape == (w.n,) and bias.is_contiguous()):
        raise ValueError(f"decoder layers: bias must be a contiguous float32 [{w.n}] tensor")
    return SSLin(wptr, sptr or None, None if bias is None else bias.data_ptr(), w.n, row_bytes, fmt,
                 int(w.act_block is not None))


def decoder_library(impl: str | None = None) -> ctypes.CDLL | None:
    """The C library when the fused decoder-layer path can run (None: torch fallback selected or
    no compiler)."""
    return _select(impl)


def decoder_layers(lib: ctypes.CDLL, model: SSModel, layers: ctypes.Array, pools: ctypes.Array, l0: int,
                   l1: int, rows: SSRows, window_rows: SSRows | None, x: torch.Tensor) -> None:
    """Run layers l0 .. l1 - 1 on x [T, hidden] in place (csrc/decoder.h: ss_decoder_layers);
    window_rows: the slots / block tables of the sliding-window layers' own pools, or None.

    The caller validates the descriptors once (models/fused.py); x must be a contiguous float32
    [T, hidden] tensor."""
    _check(lib.ss_decoder_layers(ctypes.byref(model), layers, pools, l0, l1, ctypes.byref(rows),
                                 None if window_rows is None else ctypes.byref(window_rows), x.data_ptr(),
                                 get_num_threads()), "decoder_layers")
