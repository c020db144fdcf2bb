"""``system_fingerprint``: which deployment answered, as OpenAI's field means it.

A hash of the model's identity (its weights' content hash, not its path) and the engine
configuration that shapes outputs or speed: activation dtype, weight formats, KV cache dtype,
speculative config (and the drafter's weights), engine limits and seed, the chat template, and
the specserve version. The same flags on the same files give the same fingerprint after a restart; changing
the speculative config or the KV dtype changes it. Nothing that varies from run to run (free
memory, the pool size derived from it, timings, paths) goes in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from specserve import __version__


def describe(engine: Any, chat_template: str | None = None) -> dict[str, Any]:
    """What the fingerprint hashes, for an AsyncEngine (or a stand-in with the server's interface) and
    the chat template in use (its text decides the prompts)."""
    template = hashlib.sha256(chat_template.encode()).hexdigest()[:16] if chat_template else None
    out: dict[str, Any] = {"specserve": __version__, "model": engine.model_name,
                           "max_model_len": engine.max_model_len, "chat_template": template,
                           "speculative": bool(getattr(engine, "spec_enabled", False))}
    core = getattr(engine, "engine", None)  # the LLMEngine behind an AsyncEngine
    if core is None:
        return out
    model = core.model
    formats = weight_formats(model)
    out.update(weights=core.target.identity, device=core.device.type, dtype=str(model.dtype),
               weight_formats=formats, kv_cache_dtype=core.plan.kv_dtype,
               engine=dataclasses.asdict(core.ecfg),
               speculative=dataclasses.asdict(core.speculative) if core.speculative is not None else None,
               drafter=_drafter_identity(core.drafter))
    return out


def weight_formats(model) -> list[str]:
    """The run-time formats of the model's linears (its LM head included)."""
    from specserve.models.layers import linears

    return sorted({lin.format for lin in linears(model)})


def _drafter_identity(drafter: Any) -> str | None:
    if drafter is None:
        return None
    draft = getattr(drafter, "draft", None)  # a draft model's LoadedModel
    ident = getattr(draft, "identity", None) or getattr(drafter, "identity", None)
    return ident if isinstance(ident, str) else type(drafter).__name__


def system_fingerprint(description: dict[str, Any]) -> str:
    """``fp_`` and 12 hex digits of the description's canonical JSON."""
    text = json.dumps(description, sort_keys=True, default=str, separators=(",", ":"))
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:12]
