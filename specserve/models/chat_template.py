"""Render a model's jinja chat template in a sandbox, as transformers does."""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import StrictUndefined, TemplateError, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.errors import RequestError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, **_kw) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; ``render`` returns the prompt text."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=Undefined,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **kwargs) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, bos_token=self.bos_token, eos_token=self.eos_token,
                                         **kwargs)
        except TemplateError as exc:
            raise RequestError(f"chat template error: {exc}", param="messages") from exc


_ = StrictUndefined  # exported for callers that want strict rendering
