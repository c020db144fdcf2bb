"""A small on-disk cache of file hashes (and other values derived from a file).

Hashing multi-gigabyte weights and torch's shared libraries takes seconds, so
``specserve verify`` remembers each file's sha256 keyed by its absolute path
and its identity on disk: size, ``st_mtime_ns`` and inode. A file whose
identity changed is hashed again; ``full=True`` ignores the cache altogether.

The cache lives in ``$SPECSERVE_CACHE/hashcache.json`` (default
``~/.cache/specserve/hashcache.json``) and is replaced atomically. A missing,
corrupt or unwritable cache is never an error: it only costs time.

Files smaller than :data:`CACHE_MIN_BYTES` are not cached: hashing them costs
less than the lookup, and it avoids trusting the mtime of a small file that was
rewritten to the same size within one timestamp tick.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE_ENV = "SPECSERVE_CACHE"
CACHE_FILE = "hashcache.json"
CACHE_VERSION = 1
CACHE_MIN_BYTES = 1 << 20
CHUNK = 8 << 20


def default_cache_path() -> Path:
    """``$SPECSERVE_CACHE/hashcache.json`` or ``~/.cache/specserve/hashcache.json``."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "specserve"
    return base / CACHE_FILE


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path`` (no caching)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _identity(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _load(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class HashCache:
    """File hashes and derived values keyed by (absolute path, size, mtime_ns, inode).

    ``hashed`` counts the files actually read by :meth:`sha256` (cache misses).
    Call :meth:`save` once at the end to persist new entries.
    """

    def __init__(self, path: Path | None = None, *, full: bool = False):
        self.path = path or default_cache_path()
        self.full = full
        self.hashed = 0
        self.hashed_bytes = 0
        self._entries = _load(self.path)
        self._dirty: dict[str, dict] = {}
        self._fresh: set[tuple[str, str]] = set()  # computed in this run (--full)

    def value(self, path: Path, kind: str, compute: Callable[[Path], Any]) -> Any:
        """``compute(path)``, cached under ``kind`` while the file is unchanged.

        ``compute`` must return something JSON can store.
        """
        real = Path(path).resolve()
        st = real.stat()
        if st.st_size < CACHE_MIN_BYTES:
            return compute(real)
        key, ident = str(real), _identity(st)
        entry = self._dirty.get(key) or self._entries.get(key)
        if not (isinstance(entry, dict) and entry.get("id") == ident):
            entry = {"id": ident, "values": {}}
        values = entry["values"]
        if kind not in values or (self.full and (key, kind) not in self._fresh):
            values[kind] = compute(real)
            self._fresh.add((key, kind))
            self._dirty[key] = entry
        return values[kind]

    def sha256(self, path: Path) -> str:
        """The sha256 of ``path``, from the cache when the file is unchanged."""
        return self.value(path, "sha256", self._hash)

    def _hash(self, path: Path) -> str:
        self.hashed += 1
        self.hashed_bytes += path.stat().st_size
        return sha256_file(path)

    def save(self) -> None:
        """Merge new entries into the cache file (atomically); errors are ignored."""
        if not self._dirty:
            return
        entries = _load(self.path)  # another process may have written meanwhile
        for key, entry in self._dirty.items():
            entries[key] = entry
        entries = {k: v for k, v in entries.items() if os.path.exists(k)}
        try:
            _write_atomic(self.path, json.dumps({"version": CACHE_VERSION, "entries": entries},
                                                sort_keys=True, indent=1) + "\n")
        except OSError:
            return
        self._entries, self._dirty = entries, {}
