"""POST /v1/completions: raw prompts (text, texts, token ids, lists of token ids)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.engine.types import TokenLogprob
from specserve.errors import RequestError
from specserve.models.fim import fim_prompt
from specserve.server.protocol import CompletionRequest, parse_body
from specserve.server.serving import (ServingContext, check_n, check_unsupported, clean_logprob, make_choices,
                                      new_id, now, openai_sse, resolve_max_tokens, stream_usage, timings, usage,
                                      vllm_prompt_logprobs)
from specserve.server.streaming import Choice, Fanout, SSEResponse, sse, start_fanout
from specserve.server.structured import constrain


DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for legacy completions


def resolve_prompts(ctx: ServingContext, prompt, allow_empty: bool = False) -> tuple[list[list[int]], list[str]]:
    """The request's prompt(s) as token ids, plus their text (for echo). An empty one is refused,
    unless ``allow_empty`` (an infill at the start of a file has nothing before it)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    ids_list, texts = [], []
    for i, item in enumerate(prompt):
        param = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = ctx.encode_prompt(item, add_bos=True)
            text = item
        else:
            ids = list(item)
            ctx.check_token_ids(ids, param)
            text = ctx.engine.tokenizer.decode(ids, skip_special_tokens=True)
        if not ids and not allow_empty:
            raise RequestError("prompt must not be empty", param=param)
        ids_list.append(ids)
        texts.append(text)
    return ids_list, texts


def infill_prompts(ctx: ServingContext, req: CompletionRequest, prompts: list[list[int]]) -> list[list[int]]:
    """OpenAI's ``suffix``: each prompt is the text before the insertion point, ``suffix`` the text
    after it, written as the model's fill-in-the-middle prompt (it generates the middle)."""
    if ctx.fim is None:
        raise RequestError(f"suffix needs a model trained for fill-in-the-middle; {ctx.served_model_name} "
                           "has no FIM prefix/suffix/middle tokens", param="suffix")
    if req.echo:
        raise RequestError("echo cannot be combined with suffix", param="echo")
    bos = ctx.bos_id()
    suffix = ctx.engine.tokenizer.encode(req.suffix, add_special_tokens=False)
    out = []
    for ids in prompts:
        prefix = ids[1:] if bos is not None and ids[:1] == [bos] else ids
        out.append(fim_prompt(ctx.fim, prefix, suffix, bos if ids[:1] == [bos] else None))
    return out


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    req = parse_body(await request.body(), CompletionRequest)
    ctx.check_model(req.model)
    check_n(ctx, req.n)
    check_unsupported(req)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(req, name)
        if value is not None and not 0 <= value <= 20:
            raise RequestError(f"{name} must be in [0, 20], got {value}", param=name)
    if req.max_tokens == 0 and not req.echo:
        raise RequestError("max_tokens must be >= 1 (0 only with echo: the prompt alone)", param="max_tokens")
    prompts, texts = resolve_prompts(ctx, req.prompt, allow_empty=req.suffix is not None)
    if req.suffix is not None:
        prompts = infill_prompts(ctx, req, prompts)
    max_tokens = [resolve_max_tokens(ctx, req.max_tokens, DEFAULT_MAX_TOKENS, len(ids), "prompt",
                                     minimum=0 if req.echo else 1) for ids in prompts]
    request_id = new_id("cmpl")
    structured = await ctx.structured.spec_for(req)
    view = PromptView(texts if req.echo else None, req.logprobs, req.prompt_logprobs)
    choices = make_choices(prompts, req, max_tokens, req.logprobs, request_id)
    for c in choices:
        if view.engine_k is not None:
            c.params = replace(c.params, prompt_logprobs=view.engine_k)
        if req.suffix is not None:  # the model's pad / next-file tokens end an infill as EOS does
            c.params = replace(c.params, stop_token_ids=c.params.stop_token_ids + ctx.fim.end_ids)
    choices = constrain(choices, structured)
    fan = Fanout(ctx.engine, ctx.metrics, choices)
    await start_fanout(request.receive, fan, drain=not req.stream, stream=req.stream)
    if req.stream:
        events = completion_events(ctx, request_id, fan, view, *stream_usage(req))
        return SSEResponse(openai_sse(events, "completion", request_id), fan.close)
    return JSONResponse(completion_response(ctx, request_id, choices, view))


@dataclass(frozen=True)
class PromptView:
    """What a choice shows of its prompt: the echoed text (echo), with the legacy logprobs of its
    tokens when logprobs is set (OpenAI's echo + logprobs, what loglikelihood evaluations send),
    and vLLM's ``prompt_logprobs`` field."""

    echo: list[str] | None  # the prompts' text, or None without echo
    logprobs: int | None  # the request's logprobs (top n in the legacy format)
    prompt_logprobs: int | None  # the request's prompt_logprobs (vLLM's field)

    @property
    def engine_k(self) -> int | None:
        """The top n the engine computes per prompt token (None: no prompt logprobs)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def text(self, c: Choice) -> str:
        return self.echo[c.prompt_index] if self.echo else ""

    def legacy(self, ctx: ServingContext, c: Choice) -> dict | None:
        """The echoed prompt's legacy logprobs (its first token has none)."""
        if not self.echo or self.logprobs is None or c.prompt_logprobs is None:
            return None
        first = ctx.token_text(c.prompt_ids[0])  # a BOS the server added is not in the echoed text
        rest = legacy_logprobs(ctx, c.prompt_logprobs[1:], self.logprobs,
                               len(first) if self.text(c).startswith(first) else 0)
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}

    def vllm(self, ctx: ServingContext, c: Choice) -> dict:
        """vLLM's ``prompt_logprobs`` field of a choice; {} when not asked for."""
        if self.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(ctx, c.prompt_logprobs, self.prompt_logprobs)}


def legacy_logprobs(ctx: ServingContext, lps: list[TokenLogprob], k: int, offset: int) -> dict:
    """OpenAI's legacy completions format; top_logprobs holds the sampled token and the k best."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = ctx.token_text(lp.token_id)
        tokens.append(text)
        values.append(clean_logprob(lp.logprob))
        top = {text: clean_logprob(lp.logprob)}
        for token_id, value in lp.top[:k]:
            top.setdefault(ctx.token_text(token_id), clean_logprob(value))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def joined(a: dict | None, b: dict | None) -> dict | None:
    """Two legacy logprobs objects one after the other (the echoed prompt's, then the output's)."""
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}


def completion_response(ctx: ServingContext, request_id: str, choices: list[Choice], view: PromptView) -> dict:
    def one(c: Choice) -> dict:
        prefix = view.text(c)
        lps = None
        if c.params.logprobs is not None:
            lps = joined(view.legacy(ctx, c), legacy_logprobs(ctx, c.logprobs, c.params.logprobs, len(prefix)))
        return {"index": c.index, "text": prefix + c.text, "logprobs": lps, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, **view.vllm(ctx, c)}

    return {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": ctx.served_model_name,
        "system_fingerprint": ctx.system_fingerprint,
        "choices": [one(c) for c in choices],
        "usage": usage(choices),
        "timings": timings(choices),
    }


async def completion_events(ctx: ServingContext, request_id: str, fan: Fanout, view: PromptView,
                            include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "text_completion", "created": now(), "model": ctx.served_model_name,
            "system_fingerprint": ctx.system_fingerprint}
    if include_usage:
        base["usage"] = None
    offsets = {c.index: len(view.text(c)) for c in fan.choices}
    unfinished = len(fan.choices)

    def prompt_chunk(c: Choice) -> str:
        return sse({**base, "choices": [{"index": c.index, "text": view.text(c), "logprobs": view.legacy(ctx, c),
                                         "finish_reason": None, **view.vllm(ctx, c)}]})

    if view.echo and view.engine_k is None:  # the echo needs nothing computed: sent at once
        for c in fan.choices:
            yield prompt_chunk(c)
    async for choice, out in fan:
        if out.prompt_logprobs is not None:  # the prompt is computed: its chunk comes first
            yield prompt_chunk(choice)
        lps = None
        if choice.params.logprobs is not None and out.new_logprobs:
            lps = legacy_logprobs(ctx, out.new_logprobs, choice.params.logprobs, offsets[choice.index])
            offsets[choice.index] += sum(len(t) for t in lps["tokens"])
        if not out.new_text and lps is None and not out.finished:
            continue
        chunk = {**base, "choices": [{"index": choice.index, "text": out.new_text, "logprobs": lps,
                                      "finish_reason": out.finish_reason if out.finished else None,
                                      "stop_reason": out.stop_reason if out.finished else None}]}
        unfinished -= out.finished
        if continuous:
            chunk["usage"] = usage(fan.choices)
        if unfinished == 0 and not include_usage:
            chunk["timings"] = timings(fan.choices)
        yield sse(chunk)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(fan.choices), "timings": timings(fan.choices)})
