"""Collect the fingerprint of a deployment: everything that decides how it behaves.

:func:`collect` returns a JSON-ready dict of sections:

* ``specserve``, ``python``: versions;
* ``packages``: every installed distribution (PEP 503 name -> version);
* ``native``: sha256 and size of torch's shared libraries, the CUDA / cuDNN /
  NCCL libraries of ``nvidia-*`` packages and anything in ``$LD_PRELOAD``;
* ``model``, ``drafter``: sha256 and size of every file that defines them;
* ``tokenizer``, ``chat_template``: what the server will actually tokenize and render with;
* ``serve``: every ``specserve serve`` flag, defaults included;
* ``device``: CPU model and flags, and the GPUs with driver / CUDA versions;
* ``env``: the few environment variables that change behaviour, when set.

Torch is imported only when an NVIDIA or AMD driver is present, so verifying a
CPU deployment stays fast.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.errors import SpecserveError
from specserve.lock.compare import ERROR
from specserve.lock.hashcache import HashCache

LOCK_ONLY_FLAGS = ("lock", "lock_allow")
REDACTED = "<redacted>"
MISSING_FILE = "<missing>"
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
            "CUBLAS_WORKSPACE_CONFIG", "NCCL_P2P_DISABLE")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt")
_LIB_RE = re.compile(r"\.(so(\.\d+)*|dylib|dll)$")


@dataclass
class Collector:
    """How to collect: ``strict`` raises on anything missing (lock), otherwise
    the problem is recorded so that it shows up as drift (verify)."""

    cache: HashCache
    strict: bool = True
    fetch: bool = True

    def problem(self, message: str) -> str:
        """Raise ``message`` when strict, else return it as a recorded value."""
        if self.strict:
            raise SpecserveError(message)
        return f"{ERROR}{message}>"

    def file_entry(self, path: Path) -> dict[str, Any]:
        """``{"sha256", "size"}`` of one file."""
        try:
            return {"sha256": self.cache.sha256(path), "size": path.stat().st_size}
        except OSError as exc:
            return {"sha256": self.problem(f"cannot read {path}: {exc.strerror}"), "size": None}


# --------------------------------------------------------------------------- serve flags

def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``specserve serve`` arguments (defaults filled in); bad ones raise SpecserveError."""
    from specserve.commands.args import build_serve_parser

    parser = build_serve_parser()
    parser.exit_on_error = False
    try:
        ns, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise SpecserveError(f"invalid serve arguments: {exc}") from exc
    if extra:
        raise SpecserveError(f"invalid serve arguments: unrecognized {' '.join(extra)}")
    _check_values(ns)
    return ns


def _check_values(ns: argparse.Namespace) -> None:
    """What ``serve`` refuses before loading anything (engine limits, the speculative config), so a
    lock never approves a command that cannot start."""
    from specserve.engine.config import EngineConfig
    from specserve.speculative.config import parse_speculative_config

    try:
        EngineConfig.from_args(ns)
        parse_speculative_config(ns.speculative_config)
    except (SpecserveError, ValueError) as exc:
        raise SpecserveError(f"invalid serve arguments: {exc}") from exc


def canonical_flags(section: dict[str, Any]) -> dict[str, Any]:
    """The serve section with each JSON-valued flag in one spelling: ``--speculative-config`` as the
    config it parses to (key order, spacing and defaults written out or not: the same config), every
    other JSON object or array as sorted, compact JSON; a value that does not parse stays as it is."""
    from dataclasses import asdict

    from specserve.speculative.config import parse_speculative_config

    out = dict(section)
    if isinstance(section.get("served_model_name"), str):  # one name, before it took several
        out["served_model_name"] = [section["served_model_name"]]
    for key, value in section.items():
        if not isinstance(value, str) or value.lstrip()[:1] not in ("{", "["):
            continue
        try:
            parsed = json.loads(value)
            if key == "speculative_config":
                parsed = asdict(parse_speculative_config(parsed))
        except (ValueError, SpecserveError):
            continue
        out[key] = json.dumps(parsed, sort_keys=True, separators=(",", ":"))
    return out


def serve_section(ns: argparse.Namespace) -> dict[str, Any]:
    """Every serve flag by dest, minus the lock's own flags; the API key is hashed."""
    from specserve.commands.args import build_serve_parser

    dests = vars(build_serve_parser().parse_args([]))
    out = {k: getattr(ns, k, v) for k, v in dests.items() if k not in LOCK_ONLY_FLAGS}
    key = out.get("api_key")
    if key is not None:  # several keys hash as one comma-joined value (one key: as before)
        keys = [key] if isinstance(key, str) else list(key)
        joined = ",".join(keys).encode()
        out["api_key"] = REDACTED if REDACTED in keys else "sha256:" + hashlib.sha256(joined).hexdigest()
    return canonical_flags(out)


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the values of ``--api-key`` (one or several) replaced, for storing in the lock."""
    out, hide = [], False
    for arg in argv:
        hide = hide and not arg.startswith("-")
        if hide:
            out.append(REDACTED)
        elif arg.startswith("--api-key="):
            out.append("--api-key=" + REDACTED)
        else:
            out.append(arg)
        hide = hide or arg == "--api-key"
    return out


# --------------------------------------------------------------------------- runtime

def specserve_section() -> dict[str, Any]:
    """The specserve version."""
    from specserve import __version__

    return {"version": __version__}


def python_section() -> dict[str, Any]:
    """Python version, implementation and machine architecture."""
    return {"version": platform.python_version(), "implementation": platform.python_implementation(),
            "machine": platform.machine()}


def normalize_name(name: str) -> str:
    """PEP 503 normalized distribution name (``Fake_Pkg`` -> ``fake-pkg``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def packages_section() -> dict[str, str]:
    """Every installed distribution -> version; the first on ``sys.path`` wins."""
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            out.setdefault(normalize_name(name), dist.version)
    return out


def _package_dirs(name: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def native_libraries() -> dict[str, Path]:
    """Shared libraries that decide behaviour, by display name.

    torch's ``torch/lib``, the ``lib`` folders of the ``nvidia-*`` packages
    (CUDA runtime, cuDNN, NCCL, cuBLAS...) and whatever ``$LD_PRELOAD`` loads.
    """
    found: dict[str, Path] = {}
    for base in _package_dirs("torch"):
        for p in sorted((base / "lib").glob("*")):
            if p.is_file() and _LIB_RE.search(p.name):
                found[f"torch/lib/{p.name}"] = p
    for base in _package_dirs("nvidia"):
        for p in sorted(base.glob("*/lib/*")):
            if p.is_file() and _LIB_RE.search(p.name):
                found[f"nvidia/{p.parent.parent.name}/lib/{p.name}"] = p
    for item in re.split(r"[:\s]+", os.environ.get("LD_PRELOAD", "")):
        if item:
            found[f"LD_PRELOAD:{item}"] = Path(item)
    return found


def native_section(col: Collector) -> dict[str, Any]:
    """sha256 and size of every library from :func:`native_libraries`."""
    return {name: col.file_entry(path) for name, path in native_libraries().items()}


def env_section() -> dict[str, str]:
    """The behaviour-changing environment variables that are set."""
    return {k: os.environ[k] for k in ENV_VARS if k in os.environ}


# --------------------------------------------------------------------------- model files

@dataclass(frozen=True)
class ModelFiles:
    """A model resolved to files (the parts of ``ResolvedModel`` the lock needs)."""

    name: str
    kind: str  # "gguf" | "hf"
    path: Path
    files: tuple[Path, ...]
    source: str


def _fallback_resolve(spec: str) -> ModelFiles:
    path = Path(spec).expanduser()
    if path.is_file():
        path = path.resolve()
        return ModelFiles(path.stem, "gguf" if path.suffix == ".gguf" else "file", path, (path,), "file")
    if path.is_dir():
        path = path.resolve()
        files = tuple(sorted(p for p in path.rglob("*") if p.is_file()))
        kind = "hf" if (path / "config.json").is_file() else "dir"
        return ModelFiles(path.name, kind, path, files, "dir")
    raise SpecserveError(f"model '{spec}' is not a local file or directory (model catalog unavailable)")


def resolve_files(spec: str, fetch: bool) -> ModelFiles:
    """Resolve ``--model`` with the catalog, or as a local path while it is unavailable."""
    try:
        from specserve.models.catalog import resolve_model
    except ImportError as exc:
        if not (exc.name or "").startswith("specserve.models") and "resolve_model" not in str(exc):
            raise
        return _fallback_resolve(spec)
    r = resolve_model(spec, fetch=fetch)
    return ModelFiles(r.name, r.kind, Path(r.path), tuple(Path(f) for f in r.files), r.source)


def _file_key(model: ModelFiles, f: Path) -> str:
    if model.path.is_dir():
        try:
            return f.relative_to(model.path).as_posix()
        except ValueError:
            pass
    return f.name


def model_section(spec: str, col: Collector) -> tuple[dict[str, Any], ModelFiles | None]:
    """Name, kind, path and ``files.<name>.{sha256,size}`` of a model or drafter."""
    try:
        model = resolve_files(spec, col.fetch)
    except SpecserveError as exc:
        return {"name": spec, "error": col.problem(f"cannot resolve model '{spec}': {exc}")}, None
    files = {_file_key(model, f): col.file_entry(f) for f in model.files}
    return {"name": model.name, "kind": model.kind, "path": str(model.path), "source": model.source,
            "files": files}, model


def drafter_spec(speculative_config: str | None, col: Collector) -> str | None:
    """The ``"model"`` of the ``--speculative-config`` JSON, if any."""
    if not speculative_config:
        return None
    try:
        conf = json.loads(speculative_config)
    except ValueError as exc:
        col.problem(f"--speculative-config is not valid JSON: {exc}")
        return None
    model = conf.get("model") if isinstance(conf, dict) else None
    return str(model) if model else None


# --------------------------------------------------------------------------- tokenizer / template

def gguf_metadata(path: Path) -> dict[str, Any]:
    """sha256 of the GGUF's chat template and of its tokenizer fields (read with GGUFReader)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    template, tok, size = None, hashlib.sha256(), 0
    for key in sorted(reader.fields):
        field = reader.fields[key]
        if key == "tokenizer.chat_template":
            template = bytes(field.parts[field.data[0]])
        elif key.startswith("tokenizer."):
            tok.update(key.encode())
            for part in field.parts:
                data = part.tobytes()
                tok.update(data)
                size += len(data)
    return {"chat_template_sha256": hashlib.sha256(template).hexdigest() if template is not None else None,
            "tokenizer_sha256": tok.hexdigest(), "tokenizer_bytes": size}


def _gguf_meta(model: ModelFiles, col: Collector) -> dict[str, Any] | None:
    try:
        return col.cache.value(model.path, "gguf_metadata", gguf_metadata)
    except Exception as exc:  # noqa: BLE001 - a damaged GGUF is drift, or a lock error
        col.problem(f"cannot read GGUF metadata from {model.path}: {exc}")
        return None


def tokenizer_section(model: ModelFiles | None, col: Collector) -> dict[str, Any]:
    """The tokenizer: the GGUF's ``tokenizer.*`` fields, or the HF tokenizer files."""
    if model is None:
        return {"source": "unresolved"}
    if model.kind == "gguf":
        meta = _gguf_meta(model, col) or {}
        return {"source": f"gguf:{model.path.name}", "sha256": meta.get("tokenizer_sha256", MISSING_FILE),
                "size": meta.get("tokenizer_bytes")}
    files = {_file_key(model, f): col.file_entry(f) for f in model.files if f.name in TOKENIZER_FILES}
    return {"source": "files", "files": files}


def _hf_template(model: ModelFiles, col: Collector) -> dict[str, Any]:
    jinja = model.path / "chat_template.jinja"
    if jinja.is_file():
        return {"source": "chat_template.jinja", "sha256": col.file_entry(jinja)["sha256"]}
    config = model.path / "tokenizer_config.json"
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if template is None:
        return {"source": "none", "sha256": None}
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return {"source": "tokenizer_config.json", "sha256": hashlib.sha256(text.encode()).hexdigest()}


def chat_template_section(flag: str | None, model: ModelFiles | None, col: Collector) -> dict[str, Any]:
    """sha256 of the template actually used: ``--chat-template`` file, else the model's."""
    if flag:
        path = Path(flag).expanduser().resolve()
        if not path.is_file():
            return {"source": f"file:{path}", "sha256": col.problem(f"chat template {path} not found")}
        return {"source": f"file:{path}", "sha256": col.file_entry(path)["sha256"]}
    if model is None:
        return {"source": "unresolved", "sha256": None}
    if model.kind == "gguf":
        meta = _gguf_meta(model, col) or {}
        return {"source": "gguf:tokenizer.chat_template", "sha256": meta.get("chat_template_sha256")}
    if model.path.is_dir():
        return _hf_template(model, col)
    return {"source": "none", "sha256": None}


# --------------------------------------------------------------------------- device

def cpu_info() -> dict[str, Any]:
    """CPU model name, feature flags and logical CPU count (from /proc/cpuinfo on Linux)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    model = fields.get("model name") or fields.get("Hardware") or fields.get("CPU part") or platform.processor()
    flags = fields.get("flags") or fields.get("Features") or ""
    return {"model": model, "flags": sorted(set(flags.split())), "count": os.cpu_count()}


def _gpu_driver_present() -> bool:
    return any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd"))


def _nvidia_driver_version() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)", text)
    return m.group(1) if m else text.splitlines()[0].strip()


def gpu_info() -> dict[str, Any] | None:
    """GPU names, memory and capability, driver, CUDA / cuDNN / NCCL versions; None without a GPU."""
    if not _gpu_driver_present():
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    gpus = {}
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus[str(i)] = {"name": p.name, "total_memory": p.total_memory, "capability": f"{p.major}.{p.minor}"}
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - torch built without NCCL
        nccl = None
    return {"devices": gpus, "driver": _nvidia_driver_version(), "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None), "cudnn": torch.backends.cudnn.version(), "nccl": nccl}


def device_section() -> dict[str, Any]:
    """The CPU, and the GPUs when torch can use them."""
    return {"cpu": cpu_info(), "gpu": gpu_info()}


# --------------------------------------------------------------------------- everything

def collect(ns: argparse.Namespace, col: Collector) -> dict[str, Any]:
    """The whole fingerprint of a deployment started with serve arguments ``ns``."""
    model, resolved = model_section(ns.model, col)
    draft = drafter_spec(ns.speculative_config, col)
    return {
        "specserve": specserve_section(),
        "python": python_section(),
        "packages": packages_section(),
        "native": native_section(col),
        "model": model,
        "drafter": model_section(draft, col)[0] if draft else None,
        "tokenizer": tokenizer_section(resolved, col),
        "chat_template": chat_template_section(ns.chat_template, resolved, col),
        "serve": serve_section(ns),
        "device": device_section(),
        "env": env_section(),
    }
