"""POST /v1/chat/completions: render, run the choices, split reasoning, respond (JSON or SSE)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.engine.types import RequestOutput, TokenLogprob
from specserve.errors import RequestError
from specserve.server.chat import prompt_opens_think
from specserve.server.protocol import ChatCompletionRequest, parse_body
from specserve.server.reasoning import ReasoningParser, make_parser, split_all
from specserve.server.serving import (ServingContext, check_n, check_unsupported, format_logprobs, make_choices,
                                      new_id, now, openai_sse, resolve_max_tokens, stream_usage, timings, usage,
                                      vllm_prompt_logprobs)
from specserve.server.streaming import Choice, Fanout, SSEResponse, sse, start_fanout
from specserve.server.structured import constrain, start_for
from specserve.server.tools import ToolCall, ToolCallParser, ToolPlan, plan_tools
from specserve.server.tools import split_all as split_calls


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
    check_unsupported(req)
    top = requested_top_logprobs(req)
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: the response object carries them
        raise RequestError("prompt_logprobs are not available with stream", param="prompt_logprobs")
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_parser)
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true (continue the "
                           "last assistant message, or start a new one)", param="continue_final_message")
    prompt, ids, images = await ctx.chat_prompt(req.messages, req.chat_template_kwargs, req.add_generation_prompt,
                                                plan.template_tools, req.continue_final_message)
    if not ids:
        raise RequestError("the rendered prompt is empty", param="messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(ctx, requested, None, len(ids), "messages", param)
    request_id = new_id("chatcmpl")
    opened = prompt_opens_think(prompt)
    structured = await ctx.structured.spec_for(req, plan, start_for(ctx.cfg.reasoning_parser, opened))
    choices = make_choices([ids], req, [max_tokens], top, request_id, images)
    if req.prompt_logprobs is not None:  # computed once: the other choices find the prompt cached
        choices[0].params = replace(choices[0].params, prompt_logprobs=req.prompt_logprobs)
    choices = constrain(choices, structured)
    split = Splitter(ctx.cfg.reasoning_parser, opened, plan)
    fan = Fanout(ctx.engine, ctx.metrics, choices)
    await start_fanout(request.receive, fan, drain=not req.stream, stream=req.stream)
    if req.stream:
        events = chat_events(ctx, request_id, fan, split, *stream_usage(req))
        return SSEResponse(openai_sse(events, "chat", request_id), fan.close)
    body = chat_response(ctx, request_id, choices, split)
    if req.prompt_logprobs is not None:  # vLLM's: beside the choices, which share the prompt
        body["prompt_logprobs"] = vllm_prompt_logprobs(ctx, choices[0].prompt_logprobs, req.prompt_logprobs)
    return JSONResponse(body)


@dataclass(frozen=True)
class Splitter:
    """How a choice's text splits into reasoning, content and tool calls."""

    reasoning_parser: str
    opened: bool  # the prompt opened a <think> block
    tools: ToolPlan

    def streams(self) -> tuple[ReasoningParser | None, ToolCallParser | None]:
        return (make_parser(self.reasoning_parser, self.opened),
                ToolCallParser(self.tools) if self.tools.names else None)


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


# ---------------------------------------------------------------- formatting

def _logprobs_field(ctx: ServingContext, choice: Choice, lps: list[TokenLogprob] | None) -> dict | None:
    k = choice.params.logprobs
    if k is None:
        return None
    return {"content": format_logprobs(ctx, lps or [], k), "refusal": None}


def chat_message(choice: Choice, split: Splitter) -> tuple[dict, list[ToolCall]]:
    kind = split.reasoning_parser
    reasoning, content = split_all(kind, split.opened, choice.text)
    calls: list[ToolCall] = []
    if split.tools.names:
        content, calls = split_calls(split.tools, content)
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["content"] = content or None  # as the stream's deltas join (its whitespace kept)
        message["tool_calls"] = [c.as_dict() for c in calls]
    if kind != "none":
        if reasoning is not None and not content:
            message["content"] = None  # all reasoning: never closed, or nothing after </think>
        message["reasoning_content"] = reasoning
        message["reasoning"] = reasoning
    return message, calls


def chat_response(ctx: ServingContext, request_id: str, choices: list[Choice], split: Splitter) -> dict:
    out = []
    for c in choices:
        message, calls = chat_message(c, split)
        out.append({"index": c.index, "message": message, "logprobs": _logprobs_field(ctx, c, c.logprobs),
                    "finish_reason": finish_reason(c.finish_reason, bool(calls)), "stop_reason": c.stop_reason})
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": ctx.served_model_name,
        "system_fingerprint": ctx.system_fingerprint,
        "choices": out,
        "usage": usage(choices),
        "timings": timings(choices),
    }


# ---------------------------------------------------------------- streaming

def chat_delta(parsers: tuple[ReasoningParser | None, ToolCallParser | None], out: RequestOutput) -> dict:
    """One engine output through a choice's parsers: the chat delta (reasoning, content, tool calls;
    the keys with something in them). Also what /v1/responses builds its output items from."""
    reasoner, tooler = parsers
    if reasoner is None:
        reasoning, content = "", out.new_text
    else:
        reasoning, content = reasoner.feed(out.new_text)
        if out.finished:
            r, c = reasoner.finish()
            reasoning, content = reasoning + r, content + c
    calls: list[ToolCall] = []
    if tooler is not None:
        first = tooler.calls
        content, calls = tooler.feed(content)
        if out.finished:
            c, k = tooler.finish()
            content, calls = content + c, calls + k
    delta: dict = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
        delta["reasoning"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [call.as_dict(first + i) for i, call in enumerate(calls)]
    return delta


async def chat_events(ctx: ServingContext, request_id: str, fan: Fanout, split: Splitter,
                      include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
    created, model = now(), ctx.served_model_name
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": ctx.system_fingerprint}
    if include_usage:
        base["usage"] = None
    parsers = {c.index: split.streams() for c in fan.choices}
    unfinished = len(fan.choices)
    if continuous:  # the role chunks come before any output (the engine may be a token ahead by now)
        before = usage(fan.choices)
        before.update(completion_tokens=0, total_tokens=before["prompt_tokens"])
        before.pop("speculative", None)
    for c in fan.choices:
        first = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
        yield sse({**base, "choices": [first]} | ({"usage": before} if continuous else {}))
    async for choice, out in fan:
        delta = chat_delta(parsers[choice.index], out)
        lps = _logprobs_field(ctx, choice, out.new_logprobs) if out.new_logprobs else None
        if not delta and lps is None and not out.finished:
            continue
        called = parsers[choice.index][1] is not None and parsers[choice.index][1].calls > 0
        reason = finish_reason(out.finish_reason, called) if out.finished else None
        chunk = {**base, "choices": [{"index": choice.index, "delta": delta, "logprobs": lps, "finish_reason": reason,
                                      "stop_reason": out.stop_reason if out.finished else None}]}
        unfinished -= out.finished
        if continuous:
            chunk["usage"] = usage(fan.choices)
        if unfinished == 0 and not include_usage:
            chunk["timings"] = timings(fan.choices)
        yield sse(chunk)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(fan.choices), "timings": timings(fan.choices)})
