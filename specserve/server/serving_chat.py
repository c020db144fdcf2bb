"""POST /v1/chat/completions: render, run the choices, split reasoning, respond (JSON or SSE)."""

from __future__ import annotations

import logging
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.engine.types import RequestOutput, TokenLogprob
from specserve.errors import RequestError
from specserve.server.chat import prompt_opens_think
from specserve.server.protocol import ChatCompletionRequest, error_body, parse_body
from specserve.server.reasoning import ReasoningParser, make_parser, split_all
from specserve.server.serving import (ServingContext, check_n, check_response_format, clean_logprob, make_choices,
                                      new_id, now, resolve_max_tokens, timings, usage)
from specserve.server.streaming import SSE_DONE, Choice, Fanout, SSEResponse, sse, start_fanout

logger = logging.getLogger("specserve.server")


def requested_top_logprobs(req: ChatCompletionRequest) -> int | None:
    """Chat logprobs: ``logprobs`` (bool) turns them on, ``top_logprobs`` (0..20) sets the alternatives."""
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= 20:
            raise RequestError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    req = parse_body(await request.body(), ChatCompletionRequest)
    ctx.check_model(req.model)
    check_n(ctx, req.n)
    check_response_format(req)
    top = requested_top_logprobs(req)
    prompt = ctx.renderer.render(req.messages, req.chat_template_kwargs, req.add_generation_prompt, req.tools)
    ids = ctx.engine.tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise RequestError("the rendered prompt is empty", param="messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    try:
        max_tokens = resolve_max_tokens(ctx, requested, None, len(ids), "messages")
    except RequestError as exc:
        raise RequestError(str(exc), param=param if exc.param == "max_tokens" else exc.param, code=exc.code)
    request_id = new_id("chatcmpl")
    choices = make_choices([ids], req, [max_tokens], top, request_id)
    opened = prompt_opens_think(prompt)
    fan = Fanout(ctx.engine, ctx.metrics, choices)
    await start_fanout(request.receive, fan, drain=not req.stream)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(chat_events(ctx, request_id, fan, opened, include_usage), fan.close)
    return JSONResponse(chat_response(ctx, request_id, choices, opened))


# ---------------------------------------------------------------- formatting

def format_logprobs(ctx: ServingContext, lps: list[TokenLogprob], k: int) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": clean_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    out = []
    for lp in lps:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top[:k]]
        out.append(item)
    return out


def _logprobs_field(ctx: ServingContext, choice: Choice, lps: list[TokenLogprob] | None) -> dict | None:
    k = choice.params.logprobs
    if k is None:
        return None
    return {"content": format_logprobs(ctx, lps or [], k), "refusal": None}


def chat_message(ctx: ServingContext, choice: Choice, opened: bool) -> dict:
    kind = ctx.cfg.reasoning_parser
    reasoning, content = split_all(kind, opened, choice.text)
    message: dict = {"role": "assistant", "content": content}
    if kind != "none":
        if reasoning is not None and not content:
            message["content"] = None  # all reasoning: never closed, or nothing after </think>
        message["reasoning_content"] = reasoning
        message["reasoning"] = reasoning
    return message


def chat_response(ctx: ServingContext, request_id: str, choices: list[Choice], opened: bool) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": ctx.served_model_name,
        "choices": [{
            "index": c.index,
            "message": chat_message(ctx, c, opened),
            "logprobs": _logprobs_field(ctx, c, c.logprobs),
            "finish_reason": c.finish_reason,
        } for c in choices],
        "usage": usage(choices),
        "timings": timings(choices),
    }


# ---------------------------------------------------------------- streaming

def _delta(parser: ReasoningParser | None, out: RequestOutput) -> dict:
    if parser is None:
        reasoning, content = "", out.new_text
    else:
        reasoning, content = parser.feed(out.new_text)
        if out.finished:
            r, c = parser.finish()
            reasoning, content = reasoning + r, content + c
    delta: dict = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
        delta["reasoning"] = reasoning
    if content:
        delta["content"] = content
    return delta


async def chat_events(ctx: ServingContext, request_id: str, fan: Fanout, opened: bool,
                      include_usage: bool) -> AsyncIterator[str]:
    created, model = now(), ctx.served_model_name
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    if include_usage:
        base["usage"] = None
    parsers = {c.index: make_parser(ctx.cfg.reasoning_parser, opened) for c in fan.choices}
    unfinished = len(fan.choices)
    try:
        for c in fan.choices:
            first = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            yield sse({**base, "choices": [first]})
        async for choice, out in fan:
            delta = _delta(parsers[choice.index], out)
            lps = _logprobs_field(ctx, choice, out.new_logprobs) if out.new_logprobs else None
            if not delta and lps is None and not out.finished:
                continue
            chunk = {**base, "choices": [{"index": choice.index, "delta": delta, "logprobs": lps,
                                          "finish_reason": out.finish_reason if out.finished else None}]}
            unfinished -= out.finished
            if unfinished == 0 and not include_usage:
                chunk["timings"] = timings(fan.choices)
            yield sse(chunk)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(fan.choices), "timings": timings(fan.choices)})
    except RequestError as exc:
        yield sse(error_body(str(exc), param=exc.param, code=exc.code))
    except Exception as exc:  # noqa: BLE001 - the headers are sent; report in-band
        logger.exception("chat stream %s failed", request_id)
        yield sse(error_body(f"internal error: {type(exc).__name__}", "server_error", code="internal_error"))
    yield SSE_DONE
