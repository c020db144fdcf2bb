"""What chat and completions share: the serving context, sampling parameters,
context-length checks, choices, usage/timings and token strings."""

from __future__ import annotations

import functools
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from specserve.engine.types import INT64_MIN, INT64_MAX, SamplingParams, AcceptanceStats, TokenLogprob
from specserve.errors import RequestError, ServiceUnavailable
from specserve.models.fim import FimTokens, find_fim_tokens
from specserve.server.chat import ChatRenderer, image_urls
from specserve.server.media import MediaLoader, expand_images
from specserve.server.config import ServerConfig
from specserve.server.metrics import ServerMetrics
from specserve.server.drain import unavailable_body
from specserve.server.protocol import ApiError, SamplingFields, error_body
from specserve.server.streaming import SSE_DONE, Choice, sse
from specserve.server.structured import StructuredOutputs

logger = logging.getLogger("specserve.server")

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


@dataclass
class ServingContext:
    engine: object
    cfg: ServerConfig
    metrics: ServerMetrics
    renderer: ChatRenderer
    served_model_name: str
    tool_parser: str = "none"  # resolved: "hermes" or "none"
    system_fingerprint: str | None = None  # specserve.server.fingerprint: model + engine configuration
    media: MediaLoader | None = None  # images in requests (None: the model reads none)
    vision_cfg: object = None  # the vision tower's config (its placeholder token ids)

    @functools.cached_property
    def structured(self) -> StructuredOutputs:
        """The grammar compiler of structured outputs (its tokenizer is built on first use)."""
        return StructuredOutputs(self.engine.tokenizer, self.cfg.grammar_compile_timeout)

    @functools.cached_property
    def fim(self) -> FimTokens | None:
        """The model's fill-in-the-middle tokens (None: it has none)."""
        return find_fim_tokens(self.engine.tokenizer)

    @property
    def model_names(self) -> set[str]:
        return {self.served_model_name, self.engine.model_name, *self.cfg.model_aliases}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.served_model_name}`.", param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a piece of a multi-byte character is not U+FFFD here, as in its text)."""
        return self.engine.tokenizer.token_bytes(token_id)

    def bos_id(self) -> int | None:
        tok = self.engine.tokenizer
        bos_id = getattr(tok, "bos_token_id", None)
        if bos_id is not None:
            return bos_id
        if not tok.bos_token:
            return None
        ids = tok.encode(tok.bos_token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    async def chat_prompt(self, messages, kwargs, add_generation_prompt: bool, tools, continue_final: bool):
        """Rendered chat prompt -> (text, token ids, images): each image part read, preprocessed
        and written as its placeholder run."""
        urls = image_urls(messages)
        if urls:
            (self.media or MediaLoader(self.cfg.media, None, 1)).check_count(len(urls))
        prompt = self.renderer.render(messages, kwargs, add_generation_prompt, tools, continue_final)
        if not urls:
            return prompt, self.engine.tokenizer.encode(prompt, add_special_tokens=False), []
        images = await self.media.load(urls)
        return prompt, expand_images(self.engine.tokenizer, prompt, images, self.vision_cfg), images

    def encode_prompt(self, text: str, add_bos: bool, parse_special: bool = True) -> list[int]:
        """Raw prompt text -> ids, with BOS in front when the tokenizer wants one (``parse_special``
        false: special tokens' spellings are plain text)."""
        tok = self.engine.tokenizer
        ids = tok.encode(text, add_special_tokens=False) if parse_special else tok.encode_plain(text)
        if add_bos and getattr(self.engine.tokenizer, "add_bos", False):
            bos = self.bos_id()
            if bos is not None and ids[:1] != [bos]:
                ids = [bos] + ids
        return ids

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def resolve_max_tokens(ctx: ServingContext, requested: int | None, default: int | None, prompt_len: int,
                       prompt_param: str, param: str = "max_tokens", minimum: int = 1) -> int:
    """The completion budget, checked against the context (OpenAI's context_length_exceeded).
    ``param``: the request field that set ``requested`` (chat: max_tokens or max_completion_tokens);
    ``minimum``: 0 where a request may ask for its prompt alone (completions with echo)."""
    limit = ctx.engine.max_model_len
    if requested is not None and requested < minimum:
        raise RequestError(f"{param} must be >= {minimum}, got {requested}", param=param)
    if prompt_len >= limit:
        raise RequestError(f"This model's maximum context length is {limit} tokens, but the prompt has "
                           f"{prompt_len} tokens, which leaves no room for a completion. Shorten the prompt.",
                           param=prompt_param, code="context_length_exceeded")
    if requested is None:  # the default never overflows the context
        room = limit - prompt_len
        return room if default is None else min(default, room)
    max_tokens = requested
    if prompt_len + max_tokens > limit:
        raise RequestError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                           f"completion). Reduce the prompt or {param}.", param=param,
                           code="context_length_exceeded")
    return max_tokens


def check_n(ctx: ServingContext, n: int) -> None:
    if not 1 <= n <= ctx.cfg.max_n:
        raise RequestError(f"n must be between 1 and {ctx.cfg.max_n} (--max-n), got {n}", param="n")


# Fields of vLLM's (and OpenAI's older) API that change what is generated: ignoring one would
# return a different result than the client asked for, so a value other than the default
# (the predicate says which values are fine) is refused. Fields not named here are ignored
# and logged, as vLLM does.
_LLAMA_SAMPLER = "not supported (temperature, top_k, top_p, min_p and the penalties are)"
_NOT_SUPPORTED = {
    "use_beam_search": (lambda v: v in (None, False), "beam search is not supported"),
    "best_of": (lambda v: v in (None, 1), "best_of is not supported (use n)"),
    "length_penalty": (lambda v: v in (None, 1, 1.0), "length_penalty applies to beam search, not supported"),
    "spaces_between_special_tokens": (lambda v: v in (None, True), "not supported"),
    "allowed_token_ids": (lambda v: v is None, "not supported (logit_bias bans or forces tokens)"),
    "bad_words": (lambda v: not v, "not supported (logit_bias bans tokens)"),
    "logits_processors": (lambda v: not v, "not supported"),
    "truncate_prompt_tokens": (lambda v: v is None, "prompts are never truncated (a prompt that does not fit "
                                                    "is a 400)"),
    "echo": (lambda v: v in (None, False), "echo is supported by /v1/completions only"),
    "suffix": (lambda v: v is None, "suffix (insertion) is supported by /v1/completions only"),
    "functions": (lambda v: v is None, "the legacy functions API is not supported; use tools"),
    "function_call": (lambda v: v is None, "the legacy functions API is not supported; use tool_choice"),
    # spoken answers: this server writes text only
    "audio": (lambda v: v is None, "audio output is not supported (text only)"),
    "modalities": (lambda v: v is None or (isinstance(v, list) and all(m == "text" for m in v)),
                   "only the text modality is supported"),
    # llama-server's samplers beyond temperature / top_k / top_p / min_p / repeat_penalty (at their off values: fine)
    "mirostat": (lambda v: v in (None, 0), _LLAMA_SAMPLER),
    "typical_p": (lambda v: v in (None, 1, 1.0), _LLAMA_SAMPLER),
    "dynatemp_range": (lambda v: v in (None, 0, 0.0), _LLAMA_SAMPLER),
    "dry_multiplier": (lambda v: v in (None, 0, 0.0), _LLAMA_SAMPLER),
    "xtc_probability": (lambda v: v in (None, 0, 0.0), _LLAMA_SAMPLER),
    "top_n_sigma": (lambda v: v in (None, -1, -1.0), _LLAMA_SAMPLER),
}


def stream_usage(req: SamplingFields) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage so far in every chunk as well): stream_options' include_usage
    and vLLM's continuous_usage_stats, which acts with include_usage only (as in vLLM)."""
    opts = req.stream_options
    final = bool(opts and opts.include_usage)
    return final, final and opts.continuous_usage_stats


def check_unsupported(req: SamplingFields) -> None:
    """Refuse what the server cannot do rather than ignore it: an unknown response_format type
    and the fields of ``_NOT_SUPPORTED`` with a value other than their default. Other unknown
    fields are ignored and logged (vLLM logs them too); the structured-outputs fields are read
    by server/structured.py."""
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM
        raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
    fmt = req.response_format
    if fmt is not None and fmt.type not in ("text", "json_object", "json_schema"):
        raise RequestError(f"response_format type {fmt.type!r} is not supported ('text', 'json_object' or "
                           "'json_schema')", param="response_format.type")
    ignored = []
    for name, value in (req.model_extra or {}).items():
        if name in STRUCTURED_FIELDS:
            continue
        rule = _NOT_SUPPORTED.get(name)
        if rule is None:
            ignored.append(name)
        elif not rule[0](value):
            raise RequestError(f"{name}: {rule[1]}", param=name)
    if ignored:
        logger.info("request fields ignored: %s", ", ".join(sorted(ignored)))


# read by server/structured.py (the backend name is accepted and not used: llguidance compiles)
STRUCTURED_FIELDS = frozenset({"structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                               "guided_whitespace_pattern", "guided_decoding_backend",
                               "grammar", "json_schema"})  # llama-server's, taken on the OpenAI endpoints too


def choice_seed(seed: int, choice: int) -> int:
    """seed + choice, wrapped into the signed 64-bit range (a seed outside it is refused by SamplingParams)."""
    if not INT64_MIN <= seed <= INT64_MAX:
        return seed
    return (seed + choice - INT64_MIN) % 2 ** 64 + INT64_MIN


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
    """SamplingParams of choice ``choice``; with a seed, choice i uses seed + i. Raises RequestError."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = req.top_k if req.top_k is not None else 0
    values = dict(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if top_k == -1 else top_k,  # vLLM clients send -1 for "off"
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=None if req.seed is None else choice_seed(req.seed, choice),
        stop=tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs,
        logit_bias=logit_bias(req.logit_bias),
    )
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(values[name]):
            raise RequestError(f"{name} must be a finite number", param=name)
    return SamplingParams(**values)


_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> ((id, bias), ...) sorted by id; the values' range is
    SamplingParams' check, the ids' range the engine's."""
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise RequestError(f"logit_bias keys must be token ids (decimal digits), got {key!r}",
                               param="logit_bias")
        tok = int(key)
        if tok in out:
            raise RequestError(f"logit_bias names token {tok} twice", param="logit_bias")
        out[tok] = bias
    return tuple(sorted(out.items()))


def make_choices(prompts: list[list[int]], req: SamplingFields, max_tokens: list[int], logprobs: int | None,
                 request_id: str, images: list | None = None) -> list[Choice]:
    """n choices per prompt; choice index = prompt_index * n + i (as vLLM)."""
    choices = []
    for p, ids in enumerate(prompts):
        for i in range(req.n):
            index = p * req.n + i
            choices.append(Choice(index=index, prompt_index=p, prompt_ids=ids,
                                  params=sampling_params(req, max_tokens[p], logprobs, i),
                                  request_id=f"{request_id}-{index}", images=list(images or ())))
    return choices


def summed_spec(choices: list[Choice]) -> AcceptanceStats | None:
    specs = [c.acceptance for c in choices if c.acceptance is not None]
    if not specs:
        return None
    total = AcceptanceStats()
    for s in specs:
        total.merge(s)
    return total


def usage(choices: list[Choice]) -> dict:
    """OpenAI usage (prompt tokens once per prompt) plus usage.speculative summed over choices."""
    firsts: dict[int, Choice] = {}  # the first choice of each prompt
    for c in sorted(choices, key=lambda c: c.index):
        firsts.setdefault(c.prompt_index, c)
    prompt_tokens = sum(c.prompt_tokens or len(c.prompt_ids) for c in firsts.values())
    completion = sum(c.completion_tokens for c in choices)
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts.values())},
    }
    spec = summed_spec(choices)
    if spec is not None:
        out["speculative"] = {
            "steps": spec.steps,
            "draft_tokens": spec.draft_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "accepted_per_pos": list(spec.accepted_per_pos),
            "acceptance_rate": round(spec.acceptance_rate, 6),
            "mean_acceptance_length": round(spec.mean_acceptance_length, 6),
        }
    return out


def timings(choices: list[Choice]) -> dict:
    """llama.cpp's ``timings`` (llama-server's field names and order). ``prompt_n`` counts the prompt
    tokens the engine processed, ``cache_n`` those it found in the prefix cache; over n choices both
    are summed (each choice is its own sequence). Choices run concurrently, so the times are the
    longest choice's. ``draft_n`` / ``draft_n_accepted`` appear when the request ran with speculation
    (llama-server omits them when nothing was drafted; here a speculative deployment always says how
    much it drafted, 0 included, so the keys do not depend on one request's luck)."""
    spec = summed_spec(choices)
    cached = sum(c.cached_tokens for c in choices)
    processed = sum(max(0, (c.prompt_tokens or len(c.prompt_ids)) - c.cached_tokens) for c in choices)
    predicted = sum(c.completion_tokens for c in choices)
    prompt_ms = max((c.prefill_time for c in choices), default=0.0) * 1000
    predicted_ms = max((c.decode_time for c in choices), default=0.0) * 1000
    out = {
        "cache_n": cached,
        "prompt_n": processed,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / processed, 3) if processed else 0.0,
        "prompt_per_second": round(1000 * processed / prompt_ms, 3) if prompt_ms > 0 else 0.0,
        "predicted_n": predicted,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / predicted, 3) if predicted else 0.0,
        "predicted_per_second": round(1000 * predicted / predicted_ms, 3) if predicted_ms > 0 else 0.0,
    }
    if spec is not None:
        out["draft_n"] = spec.draft_tokens
        out["draft_n_accepted"] = spec.accepted_tokens
    return out


def clean_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def format_logprobs(ctx: ServingContext, lps: list[TokenLogprob], k: int, ids: bool = False) -> list[dict]:
    """Per token its text, logprob and bytes (its own: joined, they are the text's UTF-8), and the
    top k alternatives' ("top_logprobs"): chat's logprobs.content, and with ``ids`` (each entry's
    token id as "id") llama-server's completion_probabilities."""
    def entry(token_id: int, logprob: float) -> dict:
        text = ctx.token_text(token_id)
        out = {"id": token_id} if ids else {}
        return out | {"token": text, "logprob": clean_logprob(logprob), "bytes": list(ctx.token_bytes(token_id))}

    return [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top[:k]]} for lp in lps]


def vllm_prompt_logprobs(ctx: ServingContext, lps: list[TokenLogprob | None] | None, n: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: {logprob,
    rank, decoded_token}} for the token itself and the top n."""
    out: list[dict | None] = [None]
    for lp in (lps or [None])[1:]:
        entry = {str(lp.token_id): {"logprob": clean_logprob(lp.logprob), "rank": lp.rank,
                                    "decoded_token": ctx.token_text(lp.token_id)}}
        for rank, (token_id, value) in enumerate(lp.top[:n], 1):
            entry.setdefault(str(token_id), {"logprob": clean_logprob(value), "rank": rank,
                                             "decoded_token": ctx.token_text(token_id)})
        out.append(entry)
    return out


async def openai_sse(events: AsyncIterator[str], what: str, request_id: str, done: bool = True) -> AsyncIterator[str]:
    """A chat or completion stream's events, then [DONE] (``done``; llama-server's native stream has
    none). The headers are sent by then, so an error becomes an OpenAI error event in the stream: a
    bad request's 4xx body, the shutdown drain's (a clean ending, no traceback), or an internal
    error's (logged)."""
    try:
        async for event in events:
            yield event
    except RequestError as exc:
        yield sse(error_body(str(exc), param=exc.param, code=exc.code))
    except ServiceUnavailable as exc:
        yield sse(unavailable_body(str(exc)))
    except Exception as exc:  # noqa: BLE001 - report in-band
        logger.exception("%s stream %s failed", what, request_id)
        yield sse(error_body(f"internal error: {type(exc).__name__}", "server_error", code="internal_error"))
    finally:
        await events.aclose()  # a client gone mid-stream closes this generator: close the inner one too
    if done:
        yield SSE_DONE
