"""A response's output items, built from chat deltas, and the typed events that stream them.

The chat machinery splits a choice's text into reasoning, content and tool calls
(``serving_chat.chat_delta``); :class:`OutputBuilder` turns those deltas into the Responses
API's items: a ``reasoning`` item, a ``message`` item with one ``output_text`` part, and one
``function_call`` item per call, in the order they were written. A non-streamed response feeds
the whole output as one delta and keeps only the items, so streamed and non-streamed outputs
are the same items. Whitespace-only text between items (the newline before a call) makes no
message of its own.
"""

from __future__ import annotations

import copy
import uuid

COMPLETED, INCOMPLETE = "completed", "incomplete"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Output items from chat deltas; ``feed`` and ``finish`` return the events (without sequence
    numbers) that a stream sends for them."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item being written
        self._held = ""  # whitespace not placed yet: before a message opens, or at its end

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if delta.get("reasoning_content"):
            self._reasoning(delta["reasoning_content"], events)
        if delta.get("content"):
            self._content(delta["content"], events)
        for call in delta.get("tool_calls") or []:
            self._call(call, events)
        return events

    def finish(self, status: str = COMPLETED) -> list[dict]:
        """Close the open item: ``completed``, or ``incomplete`` when the token budget ran out."""
        events: list[dict] = []
        if self._held and self._open is not None and self._open["type"] == "message":
            self._append(self._held, events)  # the answer's own trailing whitespace
        self._held = ""
        self._close(events, status)
        return events

    # ------------------------------------------------------------ text items

    def _reasoning(self, text: str, events: list[dict]) -> None:
        if self._open is None or self._open["type"] != "reasoning":
            self._close(events)
            self._start("reasoning", events)
        self._append(text, events)

    def _content(self, text: str, events: list[dict]) -> None:
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]  # sent when more text follows; dropped before a call
        if not body:
            return
        if self._open is None or self._open["type"] != "message":
            self._close(events)
            self._start("message", events)
        self._append(body, events)

    def _start(self, kind: str, events: list[dict]) -> None:
        if kind == "message":
            item = {"id": item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        item["content"].append(part)
        events.append({**self._where(item), "type": "response.content_part.added", "content_index": 0,
                       "part": copy.deepcopy(part)})

    def _append(self, text: str, events: list[dict]) -> None:
        item = self._open
        item["content"][0]["text"] += text
        if item["type"] == "message":
            events.append({**self._where(item), "type": "response.output_text.delta", "content_index": 0,
                           "delta": text, "logprobs": []})
        else:
            events.append({**self._where(item), "type": "response.reasoning_text.delta", "content_index": 0,
                           "delta": text})

    def _close(self, events: list[dict], status: str = COMPLETED) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        part, where = item["content"][0], self._where(item)
        if item["type"] == "message":
            events.append({**where, "type": "response.output_text.done", "content_index": 0, "text": part["text"],
                           "logprobs": []})
        else:
            events.append({**where, "type": "response.reasoning_text.done", "content_index": 0,
                           "text": part["text"]})
        events.append({**where, "type": "response.content_part.done", "content_index": 0,
                       "part": copy.deepcopy(part)})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": copy.deepcopy(item)})

    # ------------------------------------------------------------ function calls

    def _call(self, call: dict, events: list[dict]) -> None:
        self._held = ""
        self._close(events)
        fn = call["function"]
        item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                "name": fn["name"], "arguments": ""}
        self.items.append(item)
        where = self._where(item)
        events.append({"type": "response.output_item.added", "output_index": where["output_index"],
                       "item": copy.deepcopy(item)})
        events.append({**where, "type": "response.function_call_arguments.delta", "delta": fn["arguments"]})
        events.append({**where, "type": "response.function_call_arguments.done", "name": fn["name"],
                       "arguments": fn["arguments"]})
        item.update(arguments=fn["arguments"], status=COMPLETED)
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": copy.deepcopy(item)})

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": next(i for i, x in enumerate(self.items) if x is item)}


def item_text(items: list[dict], kind: str) -> str:
    """All text of the items of one kind ("message" or "reasoning")."""
    return "".join(part["text"] for item in items if item["type"] == kind for part in item["content"])


def assistant_turn(items: list[dict]) -> dict:
    """The output as the assistant's chat message, for the next turn's history."""
    msg: dict = {"role": "assistant", "content": item_text(items, "message")}
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    if calls:
        msg["tool_calls"] = calls
    reasoning = item_text(items, "reasoning")
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_input(value: str | list[dict] | None) -> list[dict]:
    """A request's ``input`` as the items GET /v1/responses/{id}/input_items lists: a text as one
    user message; each message's text as a content part (input_text, or output_text for the
    assistant's); every item with an id (its own, else a new one) and a status."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value or []
    out = []
    for raw in items:
        item = {**copy.deepcopy(raw), "type": raw.get("type", "message")}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", item_id(ITEM_PREFIX.get(item["type"], "item")))
        item.setdefault("status", COMPLETED)
        out.append(item)
    return out


def item_page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """One page of a list of items, as OpenAI's cursor lists: ``order`` asc (as given) or desc,
    from the item after ``after`` (an id in the list), at most ``limit``."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise KeyError(after)
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
