"""/v1/responses: OpenAI's Responses API over the chat machinery.

A request's items become chat messages (``responses_protocol``), rendered by the chat
template with the request's tools; the choice runs through the same fan-out, sampling,
reasoning split and tool-call parser as /v1/chat/completions, so the same conversation gets
the same prompt and the same output on both endpoints. The output becomes Responses items
(``responses_output``): streamed as typed server-sent events with sequence numbers, or as one
JSON response. Responses are kept in memory (``store``, bounded, least recently used dropped
first) so that ``previous_response_id`` can continue a conversation; usage and the speculation
statistics are those of chat.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.engine.types import RequestOutput
from specserve.errors import RequestError
from specserve.server.chat import prompt_opens_think
from specserve.server.protocol import ApiError, ChatMessage, parse_body
from specserve.server.reasoning import CLOSE as THINK_CLOSE
from specserve.server.responses_output import (COMPLETED, INCOMPLETE, OutputBuilder, assistant_turn, item_id,
                                               item_page, item_text, listed_input)
from specserve.server.responses_protocol import (ResponsesRequest, chat_tool_choice, chat_tools, check_request,
                                                 input_messages, responses_param, sampling_fields)
from specserve.server.serving import ServingContext, make_choices, now, resolve_max_tokens, timings, usage
from specserve.server.serving_chat import Splitter, chat_delta
from specserve.server.streaming import Choice, Fanout, SSEResponse, start_fanout
from specserve.server.structured import constrain, start_for, text_format_source
from specserve.server.tools import ToolPlan, plan_tools

logger = logging.getLogger("specserve.server")


@dataclass(frozen=True)
class Stored:
    response: dict
    messages: tuple[dict, ...]  # the conversation without instructions, this response's output included
    input_items: tuple[dict, ...]  # this request's own input, as GET .../input_items lists it


class ResponseStore:
    """Responses kept for ``previous_response_id`` and retrieval: at most ``size`` of them, the least
    recently used dropped first. Lives in the app (no process-global state)."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        if self.size == 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Turn:
    """One request on its way through: what the response object echoes, and the conversation."""

    req: ResponsesRequest
    id: str
    conversation: list[dict]  # history + this request's input (no instructions)
    split: Splitter
    created: int = field(default_factory=now)


class ResponsesAPI:
    """The /v1/responses routes (handlers of ``(ctx, request)``, as the app's other routes)."""

    def __init__(self, store: ResponseStore):
        self.store = store

    async def create(self, ctx: ServingContext, request: Request) -> Response:
        req = parse_body(await request.body(), ResponsesRequest)
        ctx.check_model(req.model)
        check_request(req)
        history = self._history(req.previous_response_id)
        known = {c["id"] for m in history for c in m.get("tool_calls") or []}
        conversation = history + input_messages(req.input, known)
        plan = _plan(ctx, req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        prompt, ids, images = await _prompt(ctx, system + conversation, req, plan)
        if not ids:
            raise RequestError("the rendered prompt is empty", param="input")
        max_tokens = resolve_max_tokens(ctx, req.max_output_tokens, None, len(ids), "input", "max_output_tokens")
        opened = prompt_opens_think(prompt)
        split = Splitter(ctx.cfg.reasoning_parser, opened, plan)
        turn = Turn(req, item_id("resp"), conversation, split)
        structured = await ctx.structured.spec_for(None, plan, start_for(ctx.cfg.reasoning_parser, opened),
                                                   text_format_source((req.text or {}).get("format")))
        choices = constrain(make_choices([ids], sampling_fields(req), [max_tokens], None, turn.id, images),
                            structured)
        fan = Fanout(ctx.engine, ctx.metrics, choices)
        await start_fanout(request.receive, fan, drain=not req.stream, stream=req.stream)
        if req.stream:
            return SSEResponse(self._events(ctx, turn, fan), fan.close)
        builder = OutputBuilder()
        builder.feed(chat_delta(turn.split.streams(), _whole(choices[0])))
        status = _status(choices[0].finish_reason)
        builder.finish(INCOMPLETE if status != COMPLETED else COMPLETED)
        return JSONResponse(self._finish(ctx, turn, builder.items, choices, status))

    async def retrieve(self, ctx: ServingContext, request: Request) -> dict:
        return self._stored(request.path_params["response_id"]).response

    async def input_items(self, ctx: ServingContext, request: Request) -> dict:
        """GET /v1/responses/{id}/input_items: the request's input items, a page at a time (OpenAI's
        ``after``, ``limit`` 1-100 (20), ``order`` asc or desc (desc))."""
        stored = self._stored(request.path_params["response_id"])
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise RequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise RequestError(f"limit must be an integer from 1 to 100, got {q.get('limit')!r}", param="limit")
        try:
            return item_page(list(stored.input_items), q.get("after"), limit, order)
        except KeyError:
            raise RequestError(f"after: no input item {q.get('after')!r} in this response", param="after") from None

    async def delete(self, ctx: ServingContext, request: Request) -> dict:
        response_id = request.path_params["response_id"]
        self._stored(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _stored(self, response_id: str) -> Stored:
        stored = self.store.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        return stored

    def _history(self, previous: str | None) -> list[dict]:
        if previous is None:
            return []
        stored = self.store.get(previous)
        if stored is None:  # as OpenAI answers: a 400 naming the field
            raise RequestError(f"Previous response with id '{previous}' not found.", param="previous_response_id",
                               code="previous_response_not_found")
        return [dict(m) for m in stored.messages]

    def _finish(self, ctx: ServingContext, turn: Turn, items: list[dict], choices: list[Choice],
                status: str) -> dict:
        """The final response object; stored when the request asked for it."""
        incomplete = {"reason": "max_output_tokens"} if status == INCOMPLETE else None
        resp = response_object(ctx, turn, status, items, response_usage(ctx, choices[0], items), incomplete)
        resp["timings"] = timings(choices)
        if turn.req.store:
            self.store.put(turn.id, Stored(resp, tuple(turn.conversation + [assistant_turn(items)]),
                                           tuple(listed_input(turn.req.input))))
        return resp

    async def _events(self, ctx: ServingContext, turn: Turn, fan: Fanout) -> AsyncIterator[str]:
        seq = itertools.count()

        def event(obj: dict) -> str:
            obj = {**obj, "sequence_number": next(seq)}
            return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

        start = response_object(ctx, turn, "in_progress", [], None)
        yield event({"type": "response.created", "response": start})
        yield event({"type": "response.in_progress", "response": start})
        builder, parsers, choice = OutputBuilder(), turn.split.streams(), fan.choices[0]
        try:
            async for _choice, out in fan:
                for e in builder.feed(chat_delta(parsers, out)):
                    yield event(e)
            status = _status(choice.finish_reason)
            for e in builder.finish(INCOMPLETE if status != COMPLETED else COMPLETED):
                yield event(e)
            resp = self._finish(ctx, turn, builder.items, fan.choices, status)
            kind = "response.incomplete" if status == INCOMPLETE else "response.completed"
            yield event({"type": kind, "response": resp})
        except RequestError as exc:
            yield event({"type": "error", "code": exc.code, "message": str(exc), "param": exc.param})
        except Exception as exc:  # noqa: BLE001 - the headers are sent; report in-band
            logger.exception("responses stream %s failed", turn.id)
            yield event({"type": "error", "code": "internal_error", "message": f"internal error: {type(exc).__name__}",
                         "param": None})


# ---------------------------------------------------------------- helpers

def _plan(ctx: ServingContext, req: ResponsesRequest) -> ToolPlan:
    try:
        return plan_tools(chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls,
                          ctx.tool_parser)
    except RequestError as exc:
        raise RequestError(str(exc), param=responses_param(exc.param), code=exc.code) from exc


async def _prompt(ctx: ServingContext, messages: list[dict], req: ResponsesRequest, plan: ToolPlan):
    """(prompt text, token ids, images) of the conversation, as chat builds them."""
    effort = (req.reasoning or {}).get("effort")
    kwargs = {"reasoning_effort": effort} if effort else None  # for templates that read it
    try:
        return await ctx.chat_prompt([ChatMessage.model_validate(m) for m in messages], kwargs, True,
                                     plan.template_tools, False)
    except RequestError as exc:
        raise RequestError(str(exc), param=responses_param(exc.param), code=exc.code) from exc


def _whole(choice: Choice) -> RequestOutput:
    """A finished choice as one output, for the same parsers a stream feeds piece by piece."""
    return RequestOutput(request_id=choice.request_id, new_token_ids=list(choice.token_ids), new_text=choice.text,
                         new_logprobs=None, finished=True, finish_reason=choice.finish_reason,
                         prompt_tokens=choice.prompt_tokens, completion_tokens=choice.completion_tokens)


def _status(finish_reason: str | None) -> str:
    if finish_reason == "length":
        return INCOMPLETE
    return "cancelled" if finish_reason == "abort" else COMPLETED


def reasoning_tokens(ctx: ServingContext, choice: Choice, items: list[dict]) -> int:
    """Output tokens spent reasoning: up to and including </think> when that is one token, else the
    reasoning text's own token count (all of the output when the block never closed)."""
    text = item_text(items, "reasoning")
    if not text:
        return 0
    tok = ctx.engine.tokenizer
    close = tok.encode(THINK_CLOSE, add_special_tokens=False)
    if len(close) == 1 and close[0] in choice.token_ids:
        return choice.token_ids.index(close[0]) + 1
    if THINK_CLOSE not in choice.text:
        return choice.completion_tokens
    return min(choice.completion_tokens, len(tok.encode(text, add_special_tokens=False)))


def response_usage(ctx: ServingContext, choice: Choice, items: list[dict]) -> dict:
    """The Responses API's usage from chat's (``usage.speculative`` included)."""
    u = usage([choice])
    out = {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
           "output_tokens": u["completion_tokens"],
           "output_tokens_details": {"reasoning_tokens": reasoning_tokens(ctx, choice, items)},
           "total_tokens": u["total_tokens"]}
    if "speculative" in u:
        out["speculative"] = u["speculative"]
    return out


def response_object(ctx: ServingContext, turn: Turn, status: str, output: list[dict], usage_: dict | None,
                    incomplete: dict | None = None) -> dict:
    req = turn.req
    reasoning = req.reasoning or {}
    return {
        "id": turn.id,
        "object": "response",
        "created_at": turn.created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": ctx.served_model_name,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": req.store and ctx.cfg.max_stored_responses > 0,  # (--max-stored-responses 0 keeps none)
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": usage_,
        "user": req.user,
        "metadata": req.metadata or {},
    }
