"""Deployment locks: record a working deployment, refuse to start when anything drifts.

``specserve lock --out deploy.lock -- <serve args>`` writes a JSON lock with the
fingerprint of the deployment (see :mod:`specserve.lock.fingerprint`): versions
of Python, specserve and every installed distribution, hashes of torch's and
CUDA's native libraries, of the model, drafter, tokenizer and chat template,
every resolved serve flag, and the device. ``specserve verify deploy.lock``
recomputes it and names every field that changed (exit 3). File hashes are
cached by path, size, mtime and inode (:mod:`specserve.lock.hashcache`), so a
verify after the first one takes well under two seconds.

How ``specserve serve`` uses it (before building the engine)::

    if args.lock:
        from specserve.lock import verify_or_exit
        verify_or_exit(args.lock, args.lock_allow, args)   # prints, raises SystemExit(3) on drift

or, to handle the result itself::

    from specserve.lock import check_lock, format_drifts
    drifts = check_lock(args.lock, serve_argv, args.lock_allow)  # serve_argv: the serve flags
    if drifts:
        print(format_drifts(drifts, args.lock), file=sys.stderr)
        return 3

``check_lock`` raises :class:`~specserve.errors.SpecserveError` for a missing,
corrupt or unsupported lock file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specserve.errors import SpecserveError
from specserve.lock.compare import Drift, DriftList, apply_allow, diff, flatten, format_drifts, is_allowed
from specserve.lock.fingerprint import REDACTED, Collector, canonical_flags, collect, parse_serve_args, redact_argv
from specserve.lock.hashcache import HashCache

__all__ = ["DRIFT_EXIT", "Drift", "DriftList", "build_lock", "check_lock", "format_drifts", "read_lock",
           "update_lock", "verify_or_exit", "write_lock"]

FORMAT = "specserve-lock"
FORMAT_VERSION = 1
DRIFT_EXIT = 3
SECTIONS = ("specserve", "python", "packages", "native", "model", "drafter", "tokenizer",
            "chat_template", "serve", "device", "env")


def read_lock(path: str | Path) -> dict[str, Any]:
    """Load and validate a lock file; anything wrong is a one-line SpecserveError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecserveError(f"lock file {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecserveError(f"cannot read lock file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        lock = json.loads(text)
    except ValueError as exc:
        where = f" at line {exc.lineno} column {exc.colno}" if hasattr(exc, "lineno") else ""
        raise SpecserveError(f"corrupt lock file {path}: invalid JSON{where}") from None
    _validate(lock, path)
    return lock


def _validate(lock: Any, path: Path) -> None:
    if not isinstance(lock, dict) or lock.get("format") != FORMAT:
        raise SpecserveError(f"{path} is not a specserve lock file (no \"format\": \"{FORMAT}\")")
    if lock.get("format_version") != FORMAT_VERSION:
        raise SpecserveError(f"lock file {path} has format version {lock.get('format_version')!r}; "
                             f"this specserve reads version {FORMAT_VERSION}")
    argv, fp = lock.get("serve_argv"), lock.get("fingerprint")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise SpecserveError(f"corrupt lock file {path}: missing or invalid 'serve_argv'")
    if not isinstance(fp, dict):
        raise SpecserveError(f"corrupt lock file {path}: missing or invalid 'fingerprint'")
    missing = [s for s in SECTIONS if s not in fp]
    if missing:
        raise SpecserveError(f"corrupt lock file {path}: missing key 'fingerprint.{missing[0]}'")


def check_lock_path(path: str | Path, what: str = "lock file") -> Path:
    """A path a lock can be written to (a file, not a directory, where we may write), or SpecserveError;
    ``specserve lock`` checks its --out before the (slow) fingerprint."""
    path = Path(path)
    if not str(path).strip() or path.is_dir():
        raise SpecserveError(f"{what} {str(path)!r} is a directory, not a file")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not os.access(parent, os.W_OK):
        raise SpecserveError(f"cannot write {what} {path}: no permission in {parent}")
    return path


def write_lock(path: str | Path, lock: dict[str, Any]) -> None:
    """Write ``lock`` as sorted, indented JSON, atomically."""
    path = check_lock_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise SpecserveError(f"cannot write lock file {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(lock, sort_keys=True, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fingerprint(ns: argparse.Namespace, *, strict: bool, full: bool) -> dict[str, Any]:
    cache = HashCache(full=full)
    try:
        return collect(ns, Collector(cache, strict=strict, fetch=strict))
    finally:
        cache.save()


def build_lock(serve_argv: list[str], *, full: bool = False) -> dict[str, Any]:
    """Collect the fingerprint for ``serve_argv`` (strictly: anything missing raises)."""
    fp = _fingerprint(parse_serve_args(serve_argv), strict=True, full=full)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "serve_argv": redact_argv(serve_argv),
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "fingerprint": fp}


def _keep_redacted_key(locked: dict[str, Any], current: dict[str, Any]) -> None:
    """An API key redacted in the stored argv cannot be checked: keep the locked hash."""
    if current["serve"].get("api_key") == REDACTED:
        current["serve"]["api_key"] = locked.get("serve", {}).get("api_key")


def _compare(lock: dict[str, Any], ns: argparse.Namespace, allow: list[str], full: bool) -> DriftList:
    current = _fingerprint(ns, strict=False, full=full)
    if isinstance(lock["fingerprint"].get("serve"), dict):  # a lock written before the flags were canonical
        lock["fingerprint"]["serve"] = canonical_flags(lock["fingerprint"]["serve"])
    _keep_redacted_key(lock["fingerprint"], current)
    check_rules(allow, lock["fingerprint"], current)
    return apply_allow(diff(lock["fingerprint"], current), list(allow))


def check_rules(allow: list[str], *fingerprints: dict[str, Any]) -> None:
    """An allow rule that matches no field is a typo: it would let nothing through, silently."""
    fields = set().union(*(flatten(fp) for fp in fingerprints))
    for rule in allow:
        if not any(is_allowed(f, [rule]) for f in fields):
            raise SpecserveError(f"--lock-allow {rule!r} matches no field of the lock (sections: "
                                 f"{', '.join(SECTIONS)}; e.g. packages.torch, serve.max_num_seqs)")


def check_lock(lock_path: str, serve_argv: list[str] | None, allow: list[str],
               full: bool = False) -> DriftList:
    """Recompute the fingerprint and compare it with the lock at ``lock_path``.

    ``serve_argv`` None means the serve arguments stored in the lock. Returns
    the drifts not matched by an ``allow`` rule (empty: the deployment matches);
    the result also carries ``checked`` (fields compared) and ``allowed``.
    """
    lock = read_lock(lock_path)
    argv = lock["serve_argv"] if serve_argv is None else list(serve_argv)
    return _compare(lock, parse_serve_args(argv), allow, full)


def verify_or_exit(lock_path: str, allow: list[str], serve_args_namespace: argparse.Namespace,
                   full: bool = False) -> None:
    """For ``specserve serve --lock``: print the result; on drift raise ``SystemExit(3)``.

    ``serve_args_namespace`` is serve's parsed arguments (extra attributes such
    as ``func`` are ignored). A bad lock file raises SpecserveError.
    """
    drifts = _compare(read_lock(lock_path), serve_args_namespace, allow, full)
    if drifts:
        print(format_drifts(drifts, lock_path), file=sys.stderr)
        print("refusing to start (allow a field with --lock-allow FIELD, or record the change "
              f"with `specserve lock --update --out {lock_path}`)", file=sys.stderr)
        raise SystemExit(DRIFT_EXIT)
    print(format_drifts(drifts, lock_path), file=sys.stderr)


def update_lock(lock_path: str, serve_argv: list[str] | None = None, *, full: bool = False) -> list[Drift]:
    """Rewrite the lock after an intended change; return every field that changed.

    ``serve_argv`` None reuses the serve arguments stored in the lock.
    """
    old = read_lock(lock_path)
    argv = old["serve_argv"] if serve_argv is None else list(serve_argv)
    new = build_lock(argv, full=full)
    _keep_redacted_key(old["fingerprint"], new["fingerprint"])
    write_lock(lock_path, new)
    return list(diff(old["fingerprint"], new["fingerprint"]))
