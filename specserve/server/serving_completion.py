"""POST /v1/completions: raw prompts (text, texts, token ids, lists of token ids)."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.engine.types import TokenLogprob
from specserve.errors import RequestError
from specserve.server.protocol import CompletionRequest, parse_body
from specserve.server.serving import (ServingContext, check_n, check_unsupported, clean_logprob, make_choices,
                                      new_id, now, openai_sse, resolve_max_tokens, timings, usage)
from specserve.server.streaming import Choice, Fanout, SSEResponse, sse, start_fanout
from specserve.server.structured import constrain


DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for legacy completions


def resolve_prompts(ctx: ServingContext, prompt) -> tuple[list[list[int]], list[str]]:
    """The request's prompt(s) as token ids, plus their text (for echo)."""
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
        if not ids:
            raise RequestError("prompt must not be empty", param=param)
        ids_list.append(ids)
        texts.append(text)
    return ids_list, texts


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    req = parse_body(await request.body(), CompletionRequest)
    ctx.check_model(req.model)
    check_n(ctx, req.n)
    check_unsupported(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise RequestError(f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    if req.echo and req.logprobs is not None:
        raise RequestError("echo with logprobs is not supported (no prompt logprobs)", param="echo")
    prompts, texts = resolve_prompts(ctx, req.prompt)
    max_tokens = [resolve_max_tokens(ctx, req.max_tokens, DEFAULT_MAX_TOKENS, len(ids), "prompt")
                  for ids in prompts]
    request_id = new_id("cmpl")
    structured = await ctx.structured.spec_for(req)
    choices = constrain(make_choices(prompts, req, max_tokens, req.logprobs, request_id), structured)
    echo = texts if req.echo else None
    fan = Fanout(ctx.engine, ctx.metrics, choices)
    await start_fanout(request.receive, fan, drain=not req.stream)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(openai_sse(completion_events(ctx, request_id, fan, echo, include_usage), "completion",
                                      request_id), fan.close)
    return JSONResponse(completion_response(ctx, request_id, choices, echo))


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


def completion_response(ctx: ServingContext, request_id: str, choices: list[Choice],
                        echo: list[str] | None) -> dict:
    def one(c: Choice) -> dict:
        prefix = echo[c.prompt_index] if echo else ""
        lps = legacy_logprobs(ctx, c.logprobs, c.params.logprobs, 0) if c.params.logprobs is not None else None
        return {"index": c.index, "text": prefix + c.text, "logprobs": lps, "finish_reason": c.finish_reason}

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


async def completion_events(ctx: ServingContext, request_id: str, fan: Fanout, echo: list[str] | None,
                            include_usage: bool) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "text_completion", "created": now(), "model": ctx.served_model_name,
            "system_fingerprint": ctx.system_fingerprint}
    if include_usage:
        base["usage"] = None
    offsets = {c.index: 0 for c in fan.choices}
    unfinished = len(fan.choices)
    if echo:
        for c in fan.choices:
            entry = {"index": c.index, "text": echo[c.prompt_index], "logprobs": None, "finish_reason": None}
            yield sse({**base, "choices": [entry]})
    async for choice, out in fan:
        lps = None
        if choice.params.logprobs is not None and out.new_logprobs:
            lps = legacy_logprobs(ctx, out.new_logprobs, choice.params.logprobs, offsets[choice.index])
            offsets[choice.index] += sum(len(t) for t in lps["tokens"])
        if not out.new_text and lps is None and not out.finished:
            continue
        chunk = {**base, "choices": [{"index": choice.index, "text": out.new_text, "logprobs": lps,
                                      "finish_reason": out.finish_reason if out.finished else None}]}
        unfinished -= out.finished
        if unfinished == 0 and not include_usage:
            chunk["timings"] = timings(fan.choices)
        yield sse(chunk)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(fan.choices), "timings": timings(fan.choices)})
