"""``--speculative-config``: vLLM-shaped JSON, validated strictly (unknown keys are errors)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from specserve.errors import SpecserveError
from specserve.models.quant import QUANTIZATIONS

METHODS = ("ngram", "draft_model", "dflash", "mtp", "suffix", "chain")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_max_spec_offset", "suffix_decoding_min_token_prob")
DEFAULT_DRAFT_LOOKUP = 3
DEFAULT_DRAFT_WINDOW = 512
CHAIN_KEYS = ("method", "drafters", "num_speculative_tokens", "adaptive")  # the rest belongs to a drafter


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
    draft_vocab_size: int | None = None  # draft_model / dflash / mtp: cut the draft's LM head to this many tokens
    draft_p_min: float = 0.0  # draft_model / dflash / mtp: stop the draft at a token the draft gives less
    # draft_model: tokens of prompt lookup (prompt_lookup_min / max) the draft model checks in each of its
    # forwards besides its next token; each one it agrees with is a draft token without a forward of its own
    # (None: DEFAULT_DRAFT_LOOKUP; 0: off)
    draft_lookup_tokens: int | None = None
    # draft_model: a draft model behind by more than this many tokens of a sequence (a long prompt) reads
    # only the sequence's first tokens and its last draft_window, not all it missed (None:
    # DEFAULT_DRAFT_WINDOW; 0: it reads everything)
    draft_window: int | None = None
    # suffix (vLLM's names; None: the defaults in spec/suffix.py)
    suffix_decoding_max_tree_depth: int | None = None  # longest context + draft the trees index
    suffix_decoding_max_cached_requests: int | None = None  # earlier outputs kept (0: only the request's own)
    suffix_decoding_max_spec_factor: float | None = None  # draft length <= factor * match length + offset
    suffix_decoding_max_spec_offset: float | None = None
    suffix_decoding_min_token_prob: float | None = None  # stop before a draft token less likely than this
    drafters: tuple["SpeculativeConfig", ...] = ()  # chain: tried in order per sequence and step

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecserveError(f"speculative config: method {self.method!r} is not one of {', '.join(METHODS)}")
        self._check_suffix()
        self._check_chain()
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
            if self.method not in ("draft_model", "dflash", "mtp"):
                raise SpecserveError("speculative config: draft_vocab_size applies to methods \"draft_model\", "
                                     "\"dflash\" and \"mtp\" only")
            if self.draft_vocab_size < 256:
                raise SpecserveError(f"speculative config: draft_vocab_size must be >= 256, got {self.draft_vocab_size}")
        if self.draft_p_min:
            if self.method in ("ngram", "suffix", "chain"):
                raise SpecserveError("speculative config: draft_p_min applies to methods \"draft_model\", "
                                     "\"dflash\" and \"mtp\" (ngram drafts have no probabilities; suffix has "
                                     "suffix_decoding_min_token_prob; a chain's drafters take their own)")
            if not 0 <= self.draft_p_min < 1:
                raise SpecserveError(f"speculative config: draft_p_min must be in [0, 1), got {self.draft_p_min}")
        if self.draft_lookup_tokens is not None:
            if self.method != "draft_model":
                raise SpecserveError("speculative config: draft_lookup_tokens applies to method \"draft_model\" only")
            if not 0 <= self.draft_lookup_tokens <= 16:
                raise SpecserveError("speculative config: draft_lookup_tokens must be in [0, 16], got "
                                     f"{self.draft_lookup_tokens}")
        if self.draft_window is not None:
            if self.method != "draft_model":
                raise SpecserveError("speculative config: draft_window applies to method \"draft_model\" only")
            if self.draft_window != 0 and not 64 <= self.draft_window <= 1 << 20:
                raise SpecserveError("speculative config: draft_window must be 0 (off) or in [64, 1048576], got "
                                     f"{self.draft_window}")
        if self.method in ("ngram", "suffix") and (self.model is not None or self.quantization is not None):
            raise SpecserveError("speculative config: \"model\" and \"quantization\" do not apply to method "
                                 f"\"{self.method}\" (it drafts from the context)")
        if self.method in ("draft_model", "dflash") and not self.model:
            raise SpecserveError(f"speculative config: method {self.method!r} needs \"model\"")

    def _check_suffix(self) -> None:
        given = [k for k in SUFFIX_KEYS if getattr(self, k) is not None]
        if self.method != "suffix":
            if given:
                raise SpecserveError(f"speculative config: {given[0]} applies to method \"suffix\" only")
            return
        depth, cached = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        if depth is not None and not 1 <= depth <= 1024:
            raise SpecserveError(f"speculative config: suffix_decoding_max_tree_depth must be in [1, 1024], got {depth}")
        if cached is not None and cached < 0:
            raise SpecserveError(f"speculative config: suffix_decoding_max_cached_requests must be >= 0, got {cached}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if factor is not None and factor < 0:
            raise SpecserveError(f"speculative config: suffix_decoding_max_spec_factor must be >= 0, got {factor}")
        if prob is not None and not 0 <= prob <= 1:
            raise SpecserveError(f"speculative config: suffix_decoding_min_token_prob must be in [0, 1], got {prob}")

    def _check_chain(self) -> None:
        if self.method != "chain":
            if self.drafters:
                raise SpecserveError(f"speculative config: \"drafters\" applies to method \"chain\" only "
                                     f"(method is {self.method!r})")
            return
        if not self.drafters:
            raise SpecserveError("speculative config: method \"chain\" needs a non-empty \"drafters\" list")
        seen = set()
        for i, d in enumerate(self.drafters):
            if not isinstance(d, SpeculativeConfig):
                raise SpecserveError(f"speculative config: drafters[{i}] must be a speculative config object")
            if d.method == "chain":
                raise SpecserveError(f"speculative config: drafters[{i}] is a chain; chains do not nest")
            if d.method in seen:
                raise SpecserveError(f"speculative config: drafters[{i}]: method {d.method!r} appears twice in "
                                     "the chain")
            seen.add(d.method)
            if d.num_speculative_tokens > self.num_speculative_tokens:
                raise SpecserveError(f"speculative config: drafters[{i}] ({d.method}) has num_speculative_tokens "
                                     f"{d.num_speculative_tokens}, more than the chain's {self.num_speculative_tokens}")


_TYPES = {"method": str, "num_speculative_tokens": int, "prompt_lookup_min": int, "prompt_lookup_max": int,
          "model": str, "adaptive": bool, "quantization": str, "draft_vocab_size": int,
          "draft_p_min": (int, float), "draft_lookup_tokens": int, "draft_window": int,
          "suffix_decoding_max_tree_depth": int,
          "suffix_decoding_max_cached_requests": int, "suffix_decoding_max_spec_factor": (int, float),
          "suffix_decoding_max_spec_offset": (int, float), "suffix_decoding_min_token_prob": (int, float),
          "drafters": list}


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
        data = dict(text) if isinstance(text, dict) else text
    if not isinstance(data, dict):
        raise SpecserveError("--speculative-config must be a JSON object")
    data = _infer_method(data)
    _check_types(data)
    if data.get("method") == "chain":
        return _parse_chain(data)
    return _config(data)


def _check_types(data: dict, where: str = "") -> None:
    known = {f.name for f in fields(SpeculativeConfig)}
    for key, value in data.items():
        if key not in known:
            raise SpecserveError(f"speculative config: {where}unknown key {key!r} (known: {', '.join(sorted(known))})")
        want = _TYPES[key]
        if value is not None and (not isinstance(value, want) or (want is not bool and isinstance(value, bool))):
            kind = "a number" if isinstance(want, tuple) else want.__name__
            raise SpecserveError(f"speculative config: {where}{key!r} must be {kind}, got {value!r}")
    if data.get("method") is None:
        raise SpecserveError(f"speculative config: {where}missing key 'method' (and no \"model\" to infer it from)")


def _infer_method(data: dict) -> dict:
    """vLLM's reading of a config without "method": "model": "[ngram]" (or "ngram") is prompt lookup,
    any other "model" a draft model."""
    if data.get("method") is not None or not isinstance(data.get("model"), str):
        return data
    if data["model"] in ("[ngram]", "ngram"):
        return {k: v for k, v in data.items() if k != "model"} | {"method": "ngram"}
    return data | {"method": "draft_model"}


def _config(data: dict) -> SpeculativeConfig:
    defaults = {f.name: f.default for f in fields(SpeculativeConfig)}
    return SpeculativeConfig(**{k: v for k, v in data.items() if v is not None or defaults.get(k) is None})


def _parse_chain(data: dict) -> SpeculativeConfig:
    """A chain: its drafters parsed one by one; a drafter without num_speculative_tokens takes
    the chain's, and the chain's defaults to the largest of its drafters'."""
    extra = [k for k in data if k not in CHAIN_KEYS and data[k] is not None]
    if extra:
        raise SpecserveError(f"speculative config: {extra[0]!r} belongs in one of the chain's \"drafters\" "
                             f"(a chain takes only {', '.join(CHAIN_KEYS)})")
    subs = data.get("drafters")
    if not subs:
        raise SpecserveError("speculative config: method \"chain\" needs a non-empty \"drafters\" list")
    k = data.get("num_speculative_tokens")
    parsed = []
    for i, sub in enumerate(subs):
        where = f"drafters[{i}]: "
        if not isinstance(sub, dict):
            raise SpecserveError(f"speculative config: {where}must be a JSON object, got {sub!r}")
        sub = _infer_method(sub)
        _check_types(sub, where)
        if sub.get("method") == "chain":
            raise SpecserveError(f"speculative config: {where}a chain inside a chain; chains do not nest")
        if sub.get("adaptive") is not None:
            raise SpecserveError(f"speculative config: {where}\"adaptive\" is set on the chain, not on its drafters")
        if "drafters" in sub:
            raise SpecserveError(f"speculative config: {where}\"drafters\" applies to method \"chain\" only")
        if sub.get("num_speculative_tokens") is None and k is not None:
            sub = dict(sub, num_speculative_tokens=k)
        try:
            parsed.append(_config(sub))
        except SpecserveError as exc:  # name the drafter the message is about
            raise SpecserveError(str(exc).replace("speculative config: ", f"speculative config: {where}", 1)) from exc
    if k is None:
        k = max(d.num_speculative_tokens for d in parsed)
    adaptive = data.get("adaptive")
    return SpeculativeConfig("chain", num_speculative_tokens=k, adaptive=True if adaptive is None else adaptive,
                      drafters=tuple(parsed))
