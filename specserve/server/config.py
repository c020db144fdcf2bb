"""Server-side settings, built once from the ``serve`` flags before the model loads."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from specserve.errors import SpecserveError
from specserve.server.media import MediaConfig, parse_limit_mm
from specserve.server.tools import TOOL_PARSERS

REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None  # None: the engine's model name
    model_aliases: tuple[str, ...] = ()  # other names a request's model may give (vLLM's served names)
    chat_template: str | None = None  # template source replacing the model's
    default_chat_template_kwargs: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    reasoning_parser: str = "none"
    tool_call_parser: str = "auto"  # auto: hermes when the chat template writes <tool_call>
    api_keys: tuple[str, ...] = ()  # keys a request may send (none: the API is open)
    max_request_bytes: int = 4 * 1024 * 1024
    max_n: int = 8
    # CORS (vLLM's flags): a browser page on another origin may call the API
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_docs: bool = True  # /openapi.json and /docs (off: --disable-fastapi-docs)
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id (least recently used go)
    grammar_compile_timeout: float = 10.0  # seconds a structured-outputs grammar may take to compile
    media: MediaConfig = field(default_factory=MediaConfig)  # what images a request may bring

    def __post_init__(self) -> None:
        if self.reasoning_parser not in REASONING_PARSERS:
            raise SpecserveError(f"unknown reasoning parser {self.reasoning_parser!r}; "
                                 f"choose one of {', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise SpecserveError(f"unknown tool-call parser {self.tool_call_parser!r}; "
                                 f"choose one of {', '.join(TOOL_PARSERS)}")
        if self.max_n < 1:
            raise SpecserveError(f"--max-n must be >= 1, got {self.max_n}")
        if not self.grammar_compile_timeout > 0:
            raise SpecserveError(f"--grammar-compile-timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        if self.max_request_bytes < 1:
            raise SpecserveError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_stored_responses < 0:
            raise SpecserveError(f"--max-stored-responses must be >= 0, got {self.max_stored_responses}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, string_list(getattr(self, name), "--" + name.replace("_", "-")))
        if not isinstance(self.default_chat_template_kwargs, MappingProxyType):
            object.__setattr__(self, "default_chat_template_kwargs",
                               MappingProxyType(dict(self.default_chat_template_kwargs)))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        names = args.served_model_name or []
        model = getattr(args, "model", None)
        return cls(
            served_model_name=names[0] if names else None,
            model_aliases=tuple(names[1:]) if names else ((model,) if isinstance(model, str) else ()),
            chat_template=read_chat_template(args.chat_template),
            default_chat_template_kwargs=parse_template_kwargs(args.default_chat_template_kwargs),
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            api_keys=read_api_keys(args.api_key, getattr(args, "api_key_file", None)),
            max_request_bytes=args.max_request_bytes,
            max_n=args.max_n,
            allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
            enable_docs=not args.disable_fastapi_docs,
            max_stored_responses=args.max_stored_responses,
            grammar_compile_timeout=getattr(args, "grammar_compile_timeout", 10.0),
            media=media_config(args),
        )


def media_config(args: argparse.Namespace) -> MediaConfig:
    domains = getattr(args, "allowed_media_domains", None)
    if domains and not domains.strip().startswith("["):
        domains = json.dumps([d for d in domains.split(",") if d.strip()])
    return MediaConfig(allowed_domains=string_list(domains or "[]", "--allowed-media-domains"),
                       max_images=parse_limit_mm(getattr(args, "limit_mm_per_prompt", None)),
                       max_image_bytes=getattr(args, "max_image_bytes", MediaConfig.max_image_bytes),
                       fetch_timeout=getattr(args, "media_fetch_timeout", MediaConfig.fetch_timeout),
                       max_image_pixels=getattr(args, "max_image_pixels", MediaConfig.max_image_pixels))


def read_api_keys(values: list[str] | str | None, path: str | None) -> tuple[str, ...]:
    """--api-key values (each may hold several keys, comma-separated, as llama-server's) and the
    keys of --api-key-file (one a line, # comments). An empty one is an error: an unset variable
    in ``--api-key "$KEY"`` would otherwise serve the API to everyone."""
    keys: list[str] = []
    for value in [values] if isinstance(values, str) else values or []:
        parts = [k.strip() for k in value.split(",")]
        if not all(parts):
            raise SpecserveError(f"--api-key {value!r} holds an empty key (leave the flag out to serve "
                                 "without one)")
        keys += parts
    if path is not None:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise SpecserveError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise SpecserveError(f"--api-key-file {path} is not UTF-8 text") from exc
        found = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not found:
            raise SpecserveError(f"--api-key-file {path} holds no key (one a line; # starts a comment)")
        keys += found
    return tuple(dict.fromkeys(keys))


def read_chat_template(path: str | None) -> str | None:
    """--chat-template: a file's template, or (as vLLM takes it) the template itself, inline, where
    the value is no file and holds Jinja's {{ or {%."""
    if path is None:
        return None
    if not path.strip():
        raise SpecserveError("--chat-template: an empty value (a template file, or the template inline)")
    p = Path(path)
    if not p.exists() and ("{{" in path or "{%" in path):
        return path
    try:
        text = p.read_text(encoding="utf-8")
        if not text.strip():
            raise SpecserveError(f"--chat-template {path} is empty")
        return text
    except OSError as exc:
        raise SpecserveError(f"cannot read --chat-template {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise SpecserveError(f"--chat-template {path} is not UTF-8 text") from exc


def parse_template_kwargs(text: str | None) -> dict[str, object]:
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SpecserveError(f"--default-chat-template-kwargs is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise SpecserveError("--default-chat-template-kwargs must be a JSON object, "
                             f"got {type(value).__name__}")
    return value


LIST_EXAMPLES = {"--allowed-methods": '["GET", "POST"]', "--allowed-headers": '["content-type"]'}


def string_list(value: object, flag: str) -> tuple[str, ...]:
    """A list of strings (a JSON list on the command line, as vLLM's CORS flags), or SpecserveError."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise SpecserveError(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        example = LIST_EXAMPLES.get(flag, '["http://localhost:3000"]')
        raise SpecserveError(f"{flag} must be a JSON list of strings, e.g. '{example}'")
    return tuple(value)
