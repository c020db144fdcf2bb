"""Build (once) and load the C kernels in ``csrc/cpu_kernels.c``.

The shared library is compiled with the system C compiler into a cache
directory (``$SPECSERVE_CACHE/kernels`` or ``~/.cache/specserve/kernels``).
Its file name contains a hash of the sources (``csrc/*.c``, ``csrc/*.h``),
the flag candidates, the compiler version and the host CPU flags, so a stale
or foreign binary is never loaded. Concurrent processes serialize on a file lock and publish the
result with an atomic rename.

``load_library()`` returns a ``ctypes.CDLL`` or ``None`` (no compiler, build
failure); a failure is logged as a single warning line.

``SPECSERVE_KERNEL_CFLAGS`` (read at build time, part of the hash) appends
compiler flags to every candidate. It exists to test the other SIMD paths on
one machine, e.g. ``SPECSERVE_KERNEL_CFLAGS=-mno-avx512f`` builds the AVX2
path on an AVX-512 host (``-mno-avx512vnni``: AVX-512 without VNNI). It
changes which instructions compute the results, never the results.

Variants: ``native`` (``-march=native``, else AVX2, else plain), ``native256`` (``-march=native
-mno-avx512f``), and test builds with SIMD paths compiled out (``avx2``, ``novnni``, ``scalar``).
Which of native / native256 a process uses is measured once per CPU (``tune.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.c"  # includes the other csrc files
LIB_PREFIX = "libspecserve_kernels"

# Flags always used. -ffp-contract=off keeps the compiler from fusing the
# explicit mul/add pairs (dequantization must match gguf-py bit for bit, and
# the scalar path must mirror the SIMD path).
COMMON_FLAGS = ["-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
                "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas"]
# Tried in order, first that compiles wins.
ARCH_CANDIDATES = [
    ["-O3", "-march=native"],
    ["-O3", "-mavx2", "-mfma", "-mf16c"],
    ["-O3"],
]
OPENMP_FLAG = "-fopenmp"


@dataclass
class BuildResult:
    lib: ctypes.CDLL | None
    path: str | None = None
    flags: list[str] = field(default_factory=list)
    compiler: str | None = None
    compiler_version: str | None = None
    error: str | None = None
    variant: str = "native"


def cache_dir() -> Path:
    base = os.environ.get("SPECSERVE_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "specserve"
    return root / "kernels"


def find_compiler() -> str | None:
    cands = [os.environ.get("CC"), "gcc", "cc", "clang"]
    for c in cands:
        if not c:
            continue
        path = shutil.which(c)
        if path:
            return path
    return None


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except Exception as e:  # pragma: no cover - depends on the host
        return f"unknown ({e})"


def cpu_signature() -> str:
    """Host CPU identity: a -march=native binary must not be reused elsewhere."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    parts.append(line.strip())
                    if len(parts) > 3:
                        break
    except OSError:
        pass
    return "\n".join(parts)


def _extra_flags() -> list[str]:
    return os.environ.get("SPECSERVE_KERNEL_CFLAGS", "").split()


def _candidates(variant: str) -> list[list[str]]:
    # test variants: the same source with some SIMD paths compiled out, used
    # to check that every path computes bit-identical results
    if variant == "scalar":
        cands = [["-O2", "-DSS_FORCE_SCALAR"]]
    elif variant == "avx2":
        cands = [["-O3", "-mavx2", "-mfma", "-mf16c"]]
    elif variant == "novnni":  # this CPU's widest SIMD without VNNI: the maddubs dot products
        cands = [["-O3", "-march=native", "-mno-avx512vnni", "-mno-avxvnni"], ["-O3", "-mavx2", "-mfma", "-mf16c"]]
    elif variant == "native":
        cands = ARCH_CANDIDATES
    elif variant == "native256":  # an AVX-512 CPU's 256-bit build (AVX2, AVX-VNNI where present): tune.py
        cands = [["-O3", "-march=native", "-mno-avx512f"]]
    else:
        raise ValueError(f"unknown kernel build variant {variant!r}")
    extra = _extra_flags()
    return [[*c, *extra] for c in cands]


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".c", ".h"))


def _lib_key(src: bytes, cc: str, ccver: str, variant: str) -> str:
    h = hashlib.sha256()
    h.update(src)  # all sources, concatenated with their names
    h.update(json.dumps([COMMON_FLAGS, _candidates(variant), OPENMP_FLAG, variant]).encode())
    h.update(cc.encode())
    h.update(ccver.encode())
    h.update(cpu_signature().encode())
    return h.hexdigest()[:20]


def _try_compile(cc: str, flags: list[str], out: Path) -> tuple[bool, str]:
    cmd = [cc, *flags, str(SOURCE), "-o", str(out), "-lm"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except Exception as e:
        return False, f"{e}"
    if r.returncode != 0:
        return False, (r.stderr or r.stdout).strip()[-2000:]
    return True, ""


class FileLock:
    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def __enter__(self):
        try:
            import fcntl

            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except Exception:  # no fcntl (Windows) or unwritable: rely on atomic rename
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            try:
                import fcntl

                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None


def _load(path: Path) -> ctypes.CDLL:
    # torch must be imported first: the library then binds to torch's libgomp
    # (same soname) and shares its OpenMP thread pool instead of a second one.
    import torch  # noqa: F401

    return ctypes.CDLL(str(path))


def build(variant: str = "native", directory: Path | None = None) -> BuildResult:
    """Compile (if needed) and load the kernel library."""
    cc = find_compiler()
    if cc is None:
        return BuildResult(None, error="no C compiler found (set CC or install gcc)", variant=variant)
    try:
        src = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in _sources())
    except OSError as e:
        return BuildResult(None, error=f"kernel source missing: {e}", variant=variant)
    ccver = _compiler_version(cc)
    key = _lib_key(src, cc, ccver, variant)
    dirs = [Path(directory) if directory is not None else cache_dir()]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    dirs.append(Path(tempfile.gettempdir()) / f"specserve-kernels-{uid}")
    last: Exception | None = None
    for d in dirs:  # the cache dir, else a temp dir (read-only home, ...)
        try:
            d.mkdir(parents=True, exist_ok=True)
            return _build_in(d, cc, ccver, key, variant)
        except OSError as e:
            last = e
    return BuildResult(None, error=f"cannot write the kernel cache: {last}", compiler=cc,
                       compiler_version=ccver, variant=variant)


def _build_in(d: Path, cc: str, ccver: str, key: str, variant: str) -> BuildResult:
    name = f"{LIB_PREFIX}-{variant}-{key}"
    lib_path = d / f"{name}.so"
    meta_path = d / f"{name}.json"

    def _result_from_cache() -> BuildResult | None:
        if lib_path.exists() and meta_path.exists():
            try:
                meta = json.loads(meta_path.read_text())
                lib = _load(lib_path)
                return BuildResult(lib, str(lib_path), meta.get("flags", []), cc, ccver, variant=variant)
            except Exception as e:  # corrupt cache entry: rebuild
                logger.debug("could not load cached kernels %s: %s", lib_path, e)
        return None

    res = _result_from_cache()
    if res is not None:
        return res

    with FileLock(d / f"{name}.lock"):
        res = _result_from_cache()  # another process may have built it meanwhile
        if res is not None:
            return res
        errors = []
        for arch in _candidates(variant):
            for omp in ([OPENMP_FLAG], []):
                flags = [*arch, *omp, *COMMON_FLAGS]
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".so", dir=d)
                os.close(fd)
                tmp_path = Path(tmp)
                ok, err = _try_compile(cc, flags, tmp_path)
                if not ok:
                    errors.append(f"{' '.join(flags)}: {err.splitlines()[-1] if err else '?'}")
                    tmp_path.unlink(missing_ok=True)
                    continue
                try:
                    lib = _load(tmp_path)
                except OSError as e:
                    errors.append(f"{' '.join(flags)}: load failed: {e}")
                    tmp_path.unlink(missing_ok=True)
                    continue
                os.replace(tmp_path, lib_path)
                meta_tmp = d / f".{name}.json.tmp{os.getpid()}"
                meta_tmp.write_text(json.dumps({"flags": flags, "compiler": cc, "compiler_version": ccver}))
                os.replace(meta_tmp, meta_path)
                return BuildResult(lib, str(lib_path), flags, cc, ccver, variant=variant)
        return BuildResult(None, error="; ".join(errors)[-1500:] or "build failed", compiler=cc,
                           compiler_version=ccver, variant=variant)


_lock = threading.Lock()
_results: dict[str, BuildResult] = {}


def get_build(variant: str = "native") -> BuildResult:
    """Build once per process (thread safe); failures are logged once."""
    with _lock:
        res = _results.get(variant)
        if res is None:
            try:
                res = build(variant)
            except Exception as e:  # never let a build problem break imports
                res = BuildResult(None, error=f"{type(e).__name__}: {e}", variant=variant)
            if res.lib is None:
                logger.warning("specserve C kernels unavailable (%s); using the slow torch fallback",
                               (res.error or "unknown error").replace("\n", " ")[:300])
            _results[variant] = res
        return res


def load_library(variant: str = "native") -> ctypes.CDLL | None:
    return get_build(variant).lib


if __name__ == "__main__":  # python -m specserve.kernels.build
    logging.basicConfig(level=logging.INFO)
    r = get_build()
    print(json.dumps({"path": r.path, "flags": r.flags, "compiler": r.compiler, "error": r.error}, indent=2))
