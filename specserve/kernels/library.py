"""Loading the C kernel library, choosing its build (native / AVX2 / scalar / torch), threads."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any

import torch

from . import build as _build
from . import tune as _tune


class KernelError(RuntimeError):
    pass


# format ids shared with the C file
_FMT_F32, _FMT_I8, _FMT_Q8_0, _FMT_Q4_0, _FMT_Q4_1, _FMT_Q4_K, _FMT_Q6_K = range(7)

_FMT_Q5_0, _FMT_Q5_1, _FMT_Q5_K = 7, 8, 9  # dequantization only

# or-ed into a format id: the weight is in the C kernels' panel layout (csrc/panel_pack.c)
_FMT_PANEL = 0x100

# qtype -> (format id, elements per block, bytes per block)
GGUF_QTYPES: dict[str, tuple[int, int, int]] = {
    "Q8_0": (_FMT_Q8_0, 32, 34),
    "Q4_0": (_FMT_Q4_0, 32, 18),
    "Q4_1": (_FMT_Q4_1, 32, 20),
    "Q4_K": (_FMT_Q4_K, 256, 144),
    "Q6_K": (_FMT_Q6_K, 256, 210),
}

# qtypes the C kernels dequantize (bit for bit as gguf-py): the above and Q5_0 / Q5_1 / Q5_K
DEQUANT_QTYPES: dict[str, tuple[int, int, int]] = {**GGUF_QTYPES, "Q5_0": (_FMT_Q5_0, 32, 22),
                                                   "Q5_1": (_FMT_Q5_1, 32, 24), "Q5_K": (_FMT_Q5_K, 256, 176)}

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
    -9: (RuntimeError, "the tensor-parallel reduce callback failed"),
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
    lib.ss_set_prefetch_t0.argtypes = [_i32]
    lib.ss_set_prefetch_t0.restype = _i32
    lib.ss_decoder_profile.argtypes = [_i32, _vp]
    lib.ss_decoder_profile.restype = _i32
    lib.ss_dequantize.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _i32]
    lib.ss_dequantize.restype = _i32
    lib.ss_linear.argtypes = [_vp, _i64, _i64, _i64, _vp, _i32, _i64, _vp, _vp, _vp, _i64, _i64, _i32]
    lib.ss_linear.restype = _i32
    lib.ss_linear_q8.argtypes = lib.ss_linear.argtypes
    lib.ss_linear_q8.restype = _i32
    lib.ss_linear_q8_group.argtypes = [_i32, _vp, _vp, _i64, _vp, _i32, _vp, _vp, _i64, _i32]
    lib.ss_linear_q8_group.restype = _i32
    lib.ss_panel_bytes.argtypes = [_i32, _i64, _i64]
    lib.ss_panel_bytes.restype = _i64
    lib.ss_panel_pack.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _i32]
    lib.ss_panel_pack.restype = _i32
    lib.ss_panel_rows.argtypes = [_i32, _vp, _i64, _i64, _vp, _i64, _vp]
    lib.ss_panel_rows.restype = _i32
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
    lib.ss_uniform_noise.argtypes = [ctypes.c_uint64, _i64, _vp]
    lib.ss_uniform_noise.restype = _i32
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
    lib.ss_hybrid_layers.argtypes = [_vp, _vp, _vp, _i64, _i64, _vp, _vp, _vp, _i32]
    lib.ss_hybrid_layers.restype = _i32
    lib.ss_gated_delta.argtypes = [_i64] * 6 + [_vp, _i64, _vp, _vp, _i64] + [_vp] * 7 + [_vp, _i32, _i32]
    lib.ss_gated_delta.restype = _i32
    lib.ss_sigmoid_mul.argtypes = [_vp, _vp, _i64, _i64, _i64, _i64, _vp, _i32]
    lib.ss_sigmoid_mul.restype = _i32
    lib.ss_moe_combine.argtypes = [_vp, _i64, _vp, _vp, _i64, _i64, _i64, _vp, _vp, _i32]
    lib.ss_moe_combine.restype = _i32
    lib.ss_moe_route.argtypes = [_vp, _i64, _i64, _i64, _i64, _i32, _vp, _vp]
    lib.ss_moe_route.restype = _i32
    lib.ss_argmax_rows.argtypes = [_vp, _i64, _i64, _i64, _vp]
    lib.ss_argmax_rows.restype = _i32
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


def build_with_flags(flags: str) -> ctypes.CDLL:
    """The chosen build compiled with extra compiler flags (e.g. ``-DQP_PF_BYTES=4096``), for
    benchmarks that compare builds in one process (``using``)."""
    saved = os.environ.get("SPECSERVE_KERNEL_CFLAGS")
    os.environ["SPECSERVE_KERNEL_CFLAGS"] = flags
    try:
        res = _build.build(chosen_build()["variant"])
    finally:
        if saved is None:
            os.environ.pop("SPECSERVE_KERNEL_CFLAGS", None)
        else:
            os.environ["SPECSERVE_KERNEL_CFLAGS"] = saved
    if res.lib is None:
        raise RuntimeError(f"kernel build with {flags!r} failed: {res.error}")
    return _declare(res.lib)


@contextlib.contextmanager
def using(lib: ctypes.CDLL):
    """Route the chosen build's calls to ``lib`` (from build_with_flags) inside the block."""
    variant = chosen_build()["variant"]
    own = _get_lib(variant)
    _lib_cache[variant] = lib
    try:
        yield
    finally:
        _lib_cache[variant] = own


_choice_lock = threading.Lock()
_choice: dict[str, Any] = {}


def chosen_build() -> dict[str, Any]:
    """The build ``auto`` / ``c`` use ({"variant", "times", "source"}: tune.py), chosen on first use."""
    if _choice:
        return _choice
    with _choice_lock:
        if not _choice:
            try:
                _choice.update(_tune.choose())
            except _tune.BadVariant:
                raise
            except Exception as e:  # a failed contest must not break the kernels: native, as before
                _choice.update(variant="native", times={}, source=f"default ({type(e).__name__}: {e})")
            if _get_lib(_choice["variant"]) is None:
                _choice.update(variant="native", source=f"default ({_choice['variant']} did not build)")
        return _choice


def set_prefetch_t0(on: bool) -> bool:
    """The software prefetch hint of the chosen build, for the weight streams and the KV cache's rows
    alike: prefetcht0 (True) or the default prefetcht1 (tune.HintTrial picks). False when there is no
    C build to set."""
    lib = _auto_lib()
    if lib is None:
        return False
    lib.ss_set_prefetch_t0(int(on))
    return True


def prefetch_t0() -> bool | None:
    """Whether the chosen build prefetches with prefetcht0 now (None: no C build)."""
    lib = _auto_lib()
    return None if lib is None else bool(lib.ss_set_prefetch_t0(-1))


DECODER_STAGES = ("norm", "qkv", "rope + kv write", "attention", "o", "residual", "gate|up", "act_mul", "down")


def decoder_profile(on: bool | None = None) -> dict[str, float]:
    """Seconds the fused decoder layers spent per stage since profiling was last switched (a
    development tool: benchmarks/forward_breakdown.py --path fused); ``on`` then switches it on or
    off and zeroes the sums (None: neither). Empty when there is no C build."""
    lib = _auto_lib()
    if lib is None:
        return {}
    out = (ctypes.c_double * len(DECODER_STAGES))()
    n = lib.ss_decoder_profile(-1 if on is None else int(on), out)
    assert n == len(DECODER_STAGES), "decoder stages differ between the C build and library.py"
    return dict(zip(DECODER_STAGES, out))


def _auto_lib() -> ctypes.CDLL | None:
    if _get_lib() is None:
        return None
    return _get_lib(chosen_build()["variant"])


def kernels_available() -> bool:
    """True when the compiled C kernels can be used (builds them on first call)."""
    return _get_lib() is not None


_BUILDS = ("c-native", "c-native256", "c-avx2", "c-novnni", "c-scalar")
_default_impl: str | None = None  # None: read SPECSERVE_KERNELS on next use


def set_default_impl(impl: str | None) -> None:
    """Implementation used when a call passes no ``impl``: "auto" (C when
    available), "c" (C or error) or "torch" (fallback). None re-reads the
    SPECSERVE_KERNELS environment variable (it is read once, on first use)."""
    global _default_impl
    if impl is not None:
        _select(impl)  # validate
    _default_impl = impl.lower() if impl is not None else None


def _impl_name(impl: str | None) -> str:
    global _default_impl
    if impl is None:
        if _default_impl is None:
            _default_impl = (os.environ.get("SPECSERVE_KERNELS", "auto") or "auto").lower()
        impl = _default_impl
    return impl.lower()


def _is_torch(impl: str | None) -> bool:
    return _impl_name(impl) in ("torch", "fallback", "python")


def _select(impl: str | None) -> ctypes.CDLL | None:
    """The C library to use, or None for the torch fallback."""
    impl = _impl_name(impl)
    if _is_torch(impl):
        return None
    if impl in ("auto", ""):
        return _auto_lib()
    if impl == "c":
        lib = _auto_lib()
        if lib is None:
            raise KernelError(f"C kernels requested but unavailable: {_build.get_build().error}")
        return lib
    if impl in _BUILDS:  # one build by name (tests: the builds with SIMD paths compiled out)
        variant = impl[2:]
        lib = _get_lib(variant)
        if lib is None:
            raise KernelError(f"{variant} C kernels unavailable: {_build.get_build(variant).error}")
        return lib
    raise ValueError(f"unknown kernel implementation {impl!r} (expected auto, c, torch, {', '.join(_BUILDS)})")


def set_num_threads(n: int | None) -> None:
    """Threads used by the C kernels; None (default) = torch.get_num_threads().

    The count is passed to every kernel call (OpenMP ``num_threads``), so it
    does not touch torch's own setting. Results never depend on it."""
    global _num_threads_override
    if n is not None and n < 1:
        raise ValueError("thread count must be >= 1")
    _num_threads_override = int(n) if n is not None else None


@contextlib.contextmanager
def torch_one_thread():
    """Run torch's own ops on one thread: on some CPUs (seen with Intel's oneDNN/MKL GEMV) torch
    splits one dot product over its threads, so a fallback row's bits would depend on the thread
    count. The fallback is the slow path anyway."""
    prev = torch.get_num_threads()
    if prev == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def get_num_threads() -> int:
    return _num_threads_override if _num_threads_override is not None else torch.get_num_threads()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        exc, msg = _ERRORS.get(rc, (KernelError, f"error {rc}"))
        raise exc(f"{what}: {msg}")


def kernels_info() -> dict[str, Any]:
    res = _build.get_build()
    choice = chosen_build() if res.lib is not None else {"variant": None, "times": {}, "source": None}
    if choice["variant"]:
        res = _build.get_build(choice["variant"])
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
        "variant": choice["variant"],
        "variant_ms": dict(choice["times"]),
        "variant_source": choice["source"],
    }
    if lib is not None:
        lib = _get_lib(choice["variant"])
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
