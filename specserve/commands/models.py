"""``specserve models`` (list the catalog) and ``specserve pull NAME...`` (fetch ahead of time)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve.models import catalog


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``models`` and ``pull`` commands."""
    p = sub.add_parser("models", help="list the model catalog and what is cached",
                       description="List catalog models, their size and whether they are cached.")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=run_models)

    p = sub.add_parser("pull", help="download models ahead of time",
                       description="Download and verify models; print each one's path.")
    p.add_argument("names", nargs="+", metavar="NAME",
                   help="catalog name (see `specserve models`) or hub repo id")
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.set_defaults(func=run_pull)


def _human(size: int) -> str:
    if not size:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _short(path: str) -> str:
    home = str(Path.home())
    return "~" + path[len(home):] if path.startswith(home + "/") else path


def model_rows() -> list[dict]:
    """One dict per catalog entry, as ``specserve models --json`` prints them."""
    rows = []
    for e in catalog.CATALOG.values():
        status = catalog.cached_status(e)
        rows.append({
            "name": e.name, "kind": e.kind, "format": e.format, "family": e.family,
            "default": e.default, "size": e.size, "sha256": e.sha256 or None,
            "description": e.description, "status": status,
            "cached": status in ("cached", "verified", "bundled"),
            "path": str(catalog.entry_path(e)), "target": e.target,
            "packages": [f"{p.package}=={p.version}" for p in e.parts],
        })
    return rows


def run_models(args: argparse.Namespace) -> int:
    """Print the catalog as a table, or as JSON with ``--json``."""
    rows = model_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"specserve models (cache: {catalog.cache_root()})")
    for col in ("name", "kind", "size", "description", "cached", "path"):
        table.add_column(col, overflow="fold")
    for r in rows:
        name = r["name"] + (" (default)" if r["default"] else "")
        table.add_row(name, r["kind"], _human(r["size"]), r["description"], r["status"], _short(r["path"]))
    Console().print(table)
    return 0


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_pull(args: argparse.Namespace) -> int:
    """Fetch and verify each named model; print its path on stdout."""
    for name in args.names:
        entry = catalog.CATALOG.get(name)
        if entry is not None:
            path = catalog.pull(entry, force=args.force, progress=_progress)
        else:
            path = catalog.resolve_model(name, progress=_progress).path
        print(path, flush=True)
    return 0
