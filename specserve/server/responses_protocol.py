"""/v1/responses requests: the request model, and the Responses API's shapes mapped onto chat's.

A Responses conversation is a list of typed items (messages, function calls, their outputs,
reasoning). They become the chat messages the chat template renders, so /v1/responses and
/v1/chat/completions build the same prompt for the same conversation; function tools in the
Responses shape (``{"type": "function", "name": ...}``) become chat tools. Errors name the
request's own fields (``input[2].call_id``, ``tools[0].name``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ConfigDict

from specserve.errors import RequestError
from specserve.server.protocol import SamplingFields, _Lenient

logger = logging.getLogger("specserve.server")

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# sampling fields forwarded as they are to the chat machinery (vLLM accepts its extras here too)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
            "repetition_penalty")
# fields of OpenAI's API this server cannot honour: refused (not ignored) when set
_REFUSED = {
    "prompt": "reusable prompt templates are not supported; send instructions and input",
    "conversation": "the Conversations API is not supported; use previous_response_id",
}


class ResponsesRequest(_Lenient):
    """POST /v1/responses (OpenAI's fields, plus vLLM's sampling extras top_k, min_p, seed, stop,
    repetition_penalty)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


def check_request(req: ResponsesRequest) -> None:
    """Refuse what would change the result if ignored; log the other unknown fields."""
    if req.input is None and req.previous_response_id is None:
        raise RequestError("missing required field 'input'", param="input")
    if req.background:
        raise RequestError("background responses are not supported", param="background")
    if req.truncation not in (None, "auto", "disabled"):
        raise RequestError(f"truncation must be 'auto' or 'disabled', got {req.truncation!r}", param="truncation")
    if req.top_logprobs or "message.output_text.logprobs" in (req.include or []):
        raise RequestError("logprobs are not supported on /v1/responses (use /v1/chat/completions)",
                           param="top_logprobs" if req.top_logprobs else "include")
    if req.reasoning is not None and not isinstance(req.reasoning.get("effort"), (str, type(None))):
        raise RequestError("reasoning.effort must be a string", param="reasoning.effort")
    extra = dict(req.model_extra or {})
    for name, why in _REFUSED.items():
        if extra.pop(name, None) is not None:
            raise RequestError(f"{name}: {why}", param=name)
    if extra:
        logger.info("responses fields ignored: %s", ", ".join(sorted(extra)))


def sampling_fields(req: ResponsesRequest) -> SamplingFields:
    """The request's sampling knobs in the chat/completions shape, for the shared sampling code."""
    return SamplingFields(**{name: getattr(req, name) for name in SAMPLING if getattr(req, name) is not None})


# ---------------------------------------------------------------- tools

def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Responses function tools -> chat tools (a chat-shaped tool is taken as it is)."""
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise RequestError(f"tools[{i}]: tool type {tool.get('type')!r} is not supported (function tools only)",
                               param=f"tools[{i}].type")
        if isinstance(tool.get("function"), dict) and "name" not in tool:
            out.append(tool)
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict | None:
    """``{"type": "function", "name": X}`` -> chat's ``{"type": "function", "function": {"name": X}}``."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise RequestError(f"tool_choice type {choice.get('type')!r} is not supported", param="tool_choice")
    return choice


def responses_param(param: str | None) -> str | None:
    """A chat-shaped error param in the Responses request's terms."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    return param.replace(".function.", ".")


# ---------------------------------------------------------------- input items -> chat messages

def input_messages(value: str | list[dict[str, Any]] | None, known_calls: set[str]) -> list[dict]:
    """The request's ``input`` as chat messages. ``known_calls``: the call ids of the conversation
    so far (a function_call_output must answer one of them)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    conv = _Conversation(known_calls)
    for i, item in enumerate(value):
        conv.add(f"input[{i}]", item)
    return conv.messages


class _Conversation:
    def __init__(self, known_calls: set[str]):
        self.messages: list[dict] = []
        self.calls = set(known_calls)
        self.reasoning: str | None = None  # a reasoning item waiting for its assistant turn

    def add(self, where: str, item: dict) -> None:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(where, item)
        elif kind == "function_call":
            self._call(where, item)
        elif kind == "function_call_output":
            self._output(where, item)
        elif kind == "reasoning":
            self.reasoning = reasoning_text(item)
        else:
            raise RequestError(f"{where}: input item type {kind!r} is not supported (one of "
                               f"{', '.join(ITEM_TYPES)})", param=f"{where}.type")

    def _message(self, where: str, item: dict) -> None:
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise RequestError(f"{where}: role {role!r} is not one of {', '.join(INPUT_ROLES)}",
                               param=f"{where}.role")
        content = item.get("content")
        images = role == "user" and isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content)
        msg: dict[str, Any] = {"role": role, "content": image_content(where, content) if images
                               else text_content(where, content)}
        if role == "assistant":
            self._take_reasoning(msg)
        self.messages.append(msg)

    def _call(self, where: str, item: dict) -> None:
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise RequestError(f"{where}: function_call needs a string '{key}'", param=f"{where}.{key}")
        try:
            args = json.loads(item["arguments"]) if item["arguments"].strip() else {}
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            raise RequestError(f"{where}.arguments must be a JSON object", param=f"{where}.arguments")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            self.messages.append(last)
        self._take_reasoning(last)
        last.setdefault("tool_calls", []).append(call)
        self.calls.add(item["call_id"])

    def _output(self, where: str, item: dict) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise RequestError(f"{where}: function_call_output needs a string 'call_id'", param=f"{where}.call_id")
        if call_id not in self.calls:
            raise RequestError(f"{where}: no function call with call_id {call_id!r} precedes this output",
                               param=f"{where}.call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else text_content(f"{where}.output", output, "output")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def _take_reasoning(self, msg: dict) -> None:
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        self.reasoning = None


def image_content(where: str, content: list) -> list[dict]:
    """A user message's text and input_image parts, as chat content parts (the image parts read by
    server/media.py: ``image_url`` a data: or allowed http(s) URL; ``file_id`` is not supported)."""
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise RequestError(f"{where}.content[{j}]: input_image needs an image_url (file_id is not supported)",
                                   param=f"{where}.content[{j}].image_url")
            parts.append({"type": "input_image", "image_url": part["image_url"]})
        elif isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "input_text", "text": part["text"]})
        else:
            raise RequestError(f"{where}.content[{j}]: a part must be input_text with a string 'text' or "
                               "input_image", param=f"{where}.content[{j}]")
    return parts


def text_content(where: str, content: Any, field: str = "content") -> str:
    """A message's content (a string or text parts) as one string."""
    param = where if field == "output" else f"{where}.{field}"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS:
            raise RequestError(f"{param}[{j}]: content part type {kind!r} is not supported (text only: "
                               f"{', '.join(TEXT_PARTS[:2])})", param=f"{param}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{param}[{j}] ({kind}) needs a string 'text'", param=f"{param}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)  # as chat joins text parts


def reasoning_text(item: dict) -> str | None:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
            if texts:
                return "\n".join(texts)
    return None
