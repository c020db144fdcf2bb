"""``--speculative-config``: vLLM-shaped JSON, validated strictly (unknown keys are errors)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from specserve.errors import SpecserveError
from specserve.models.quant import QUANTIZATIONS

METHODS = ("ngram", "draft_model", "dflash", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (field names follow vLLM's speculative_config)."""

    method: str
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # draft model (draft_model) or drafter directory (dflash, mtp)
    adaptive: bool = True  # adapt the draft length to acceptance and verification cost
    quantization: str | None = None  # draft model weight format (default: the target's)
    draft_vocab_size: int | None = None  # draft_model / dflash: cut the draft's LM head to this many tokens
    draft_p_min: float = 0.0  # draft_model / dflash / mtp: stop the draft at a token the draft gives less

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecserveError(f"speculative config: method {self.method!r} is not one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise SpecserveError("speculative config: num_speculative_tokens must be in [1, 32], "
                                 f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpecserveError("speculative config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise SpecserveError(f"speculative config: quantization {self.quantization!r} is not one of "
                                 f"{', '.join(QUANTIZATIONS)}")
        if self.draft_vocab_size is not None:
            if self.method not in ("draft_model", "dflash"):
                raise SpecserveError("speculative config: draft_vocab_size applies to methods \"draft_model\" and "
                                     "\"dflash\" only")
            if self.draft_vocab_size < 256:
                raise SpecserveError(f"speculative config: draft_vocab_size must be >= 256, got {self.draft_vocab_size}")
        if self.draft_p_min:
            if self.method == "ngram":
                raise SpecserveError("speculative config: draft_p_min applies to methods \"draft_model\", "
                                     "\"dflash\" and \"mtp\" (ngram drafts have no probabilities)")
            if not 0 <= self.draft_p_min < 1:
                raise SpecserveError(f"speculative config: draft_p_min must be in [0, 1), got {self.draft_p_min}")
        if self.method == "ngram" and (self.model is not None or self.quantization is not None):
            raise SpecserveError("speculative config: \"model\" and \"quantization\" do not apply to method "
                                 "\"ngram\" (it drafts from the context)")
        if self.method in ("draft_model", "dflash") and not self.model:
            raise SpecserveError(f"speculative config: method {self.method!r} needs \"model\"")


_TYPES = {"method": str, "num_speculative_tokens": int, "prompt_lookup_min": int, "prompt_lookup_max": int,
          "model": str, "adaptive": bool, "quantization": str, "draft_vocab_size": int,
          "draft_p_min": (int, float)}


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """Parse the JSON of --speculative-config; None or "" means no speculation."""
    if not text:
        return None
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecserveError(f"--speculative-config is not valid JSON: {exc}") from exc
    else:
        data = dict(text)
    if not isinstance(data, dict):
        raise SpecserveError("--speculative-config must be a JSON object")
    known = {f.name for f in fields(SpeculativeConfig)}
    for key, value in data.items():
        if key not in known:
            raise SpecserveError(f"speculative config: unknown key {key!r} (known: {', '.join(sorted(known))})")
        want = _TYPES[key]
        if value is not None and (not isinstance(value, want) or (want is not bool and isinstance(value, bool))):
            kind = "a number" if isinstance(want, tuple) else want.__name__
            raise SpecserveError(f"speculative config: {key!r} must be {kind}, got {value!r}")
    if data.get("method") is None:
        raise SpecserveError("speculative config: missing key 'method'")
    defaults = {f.name: f.default for f in fields(SpeculativeConfig)}
    return SpeculativeConfig(**{k: v for k, v in data.items() if v is not None or defaults.get(k) is None})
