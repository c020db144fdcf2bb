"""Tool calling: the request's ``tools`` and ``tool_choice``, and calls parsed out of the output.

Parser ``hermes`` (Qwen2.5, Hermes 2 Pro and the many templates that copied
them) reads a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
Small models often drop the tags and answer with the bare JSON object, or the
object in a ```json fence; as llama.cpp does, an output that is only such
objects is read as calls too, but only when each names one of the request's
tools (so asking for JSON that happens to have a "name" key stays content).

One incremental parser serves streaming and non-streaming responses (the
latter feed the whole text at once), as the reasoning parser does. Text that
could still become a call is held back until it is decided; a call that does
not parse is returned as the text it was.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.errors import RequestError
from specserve.server.reasoning import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_PARSERS = ("auto", "hermes", "none")
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_FENCE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)\s*```", re.S)

# parser states
_START = "start"  # nothing but whitespace yet: the output may be a bare call
_TEXT = "text"  # content; watching for OPEN
_CALL = "call"  # inside <tool_call>: held until CLOSE
_AFTER = "after"  # just closed a call: whitespace before the next is dropped
_BARE = "bare"  # the output opened like a bare call: held to the end


def resolve_parser(setting: str, template_source: str | None) -> str:
    """'auto' -> 'hermes' when the chat template writes <tool_call> tags, else 'none'."""
    if setting != "auto":
        return setting
    return "hermes" if template_source and OPEN in template_source else "none"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str

    def as_dict(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with tools: the template's ``tools`` and the names calls may use."""

    template_tools: list[dict] | None  # None: render without tools
    names: frozenset[str]  # empty: no parsing (content stays text)
    parallel: bool = True  # False: the first call only
    forced: frozenset[str] = frozenset()  # tool_choice "required" or a named function: the output must call one


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool | None, parser: str) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice`` (OpenAI's shapes) and decide what happens. Raises RequestError."""
    names = [_tool_name(i, t) for i, t in enumerate(tools or [])]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise RequestError(f"tools name the function {dup!r} twice", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    forced = frozenset() if choice in ("none", "auto") else _forced_choice(choice, names)
    if choice != "none" and tool_choice is not None and not names:
        raise RequestError("tool_choice needs tools", param="tool_choice")
    if not names or choice == "none":
        return ToolPlan(None, frozenset())
    if forced and parser != "hermes":
        raise RequestError("tool_choice 'required' or a named function needs a tool-call parser: this chat "
                           "template writes no <tool_call> tags (start the server with --tool-call-parser hermes "
                           "and a template that has tools)", param="tool_choice")
    parse = frozenset(names) if parser == "hermes" else frozenset()
    return ToolPlan(list(tools), parse, parallel is not False, forced)


def _tool_name(i: int, tool: dict) -> str:
    fn = tool.get("function")
    if tool.get("type") != "function" or not isinstance(fn, dict):
        raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                           param=f"tools[{i}]")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.', ':' or '-', "
                           f"got {name!r}", param=f"tools[{i}].function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise RequestError(f"tools[{i}].function.parameters must be a JSON Schema object",
                           param=f"tools[{i}].function.parameters")
    return name


def _forced_choice(choice: Any, names: list[str]) -> frozenset[str]:
    """The tools a forced tool_choice lets the output call (all for "required"); raises RequestError."""
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}', param="tool_choice")
        if named not in names:
            raise RequestError(f"tool_choice names {named!r}, which is not among tools", param="tool_choice")
        return frozenset([named])
    if choice == "required":
        return frozenset(names)
    raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", ...}}, "
                       f"got {choice!r}", param="tool_choice")


def history_tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's ``tool_calls`` for the template: each call's ``arguments`` (a JSON string
    in OpenAI's API) parsed to an object, as templates write it with ``tojson``."""
    if not isinstance(calls, list):
        raise RequestError(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               "\"arguments\": ...}}", param=where)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise RequestError(f"{where}.function.arguments is not valid JSON",
                                   param=f"{where}.function.arguments") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


# ---------------------------------------------------------------- parsing calls

def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: Python's json reads them, clients' parsers do not


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)


def _call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    try:
        args = _loads(args) if isinstance(args, str) else args
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)  # 1e999 parses as inf
    except (ValueError, RecursionError):
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], text, f"call_{uuid.uuid4().hex[:24]}")


def parse_tagged(body: str, names: frozenset[str]) -> ToolCall | None:
    """The JSON between <tool_call> and </tool_call>."""
    try:
        return _call(_loads(body), names)
    except (ValueError, RecursionError):
        return None


def parse_bare(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """An output that is only call objects (or a list of them), perhaps in a ```json fence."""
    body = text.strip()
    fenced = _FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1)
    decoder, pos, calls = json.JSONDecoder(parse_constant=_no_constant), 0, []
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _call(item, names)
            if call is None:
                return None
            calls.append(call)
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
    return calls or None


def _bare_start(text: str, names: frozenset[str]) -> str:
    """'yes' if the (left-stripped) output opens like a bare call of one of ``names`` ({"name": "get_weather",
    perhaps in a fence or a list), 'no' if it cannot, 'maybe' while undecided."""
    if text.startswith("```"):
        rest = text[3:]
        if "json".startswith(rest):
            return "maybe"
        text = (rest[4:] if rest.startswith("json") else rest).lstrip()
    elif "```".startswith(text):
        return "maybe"
    if text.startswith("["):  # a list of calls
        text = text[1:].lstrip()
    for token in ("{", '"name"', ":", '"'):
        if len(text) < len(token) and token.startswith(text):
            return "maybe"
        if not text.startswith(token):
            return "no"
        text = text[len(token):] if token == '"' else text[len(token):].lstrip()
    end = text.find('"')
    if end >= 0:
        return "yes" if text[:end] in names else "no"
    return "maybe" if any(n.startswith(text) for n in names) else "no"


def _in_string(text: str) -> bool:
    """Whether JSON text ends inside a string (its quotes, not counting escaped ones, are unbalanced)."""
    inside, escaped = False, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = inside
        elif ch == '"':
            inside = not inside
    return inside


class ToolCallParser:
    """Splits the output's content into text and calls; ``feed`` per delta, ``finish`` at the end."""

    def __init__(self, plan: ToolPlan):
        self.names = plan.names
        self.parallel = plan.parallel
        self.state = _START
        self.calls = 0  # calls returned so far
        self._buf = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Consume a delta; return the content and the calls that are decided now."""
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._step(content, calls):
            pass
        return "".join(content), self._keep(calls)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: what is held back becomes calls if it parses, else content."""
        buf, self._buf = self._buf, ""
        calls: list[ToolCall] = []
        if self.state == _BARE:
            calls = parse_bare(buf, self.names) or []
        elif self.state == _CALL:  # never closed (a stop string, the token budget)
            call = parse_tagged(buf.strip(), self.names)
            calls = [call] if call else []
            buf = "" if call else OPEN + buf
        elif self.state == _AFTER and not buf.strip():
            buf = ""  # whitespace after the last call
        return ("" if calls else buf), self._keep(calls)

    def _keep(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self.parallel:
            calls = calls[:max(0, 1 - self.calls)]
        self.calls += len(calls)
        return calls

    # each step consumes from the buffer; returns True to run another step
    def _step(self, content: list[str], calls: list[ToolCall]) -> bool:
        buf = self._buf
        if not buf or self.state == _BARE:
            return False
        if self.state == _START:
            head = buf.lstrip()
            decided = _bare_start(head, self.names)
            if decided == "maybe" or (len(head) < len(OPEN) and OPEN.startswith(head)):
                return False
            self.state = _BARE if decided == "yes" else _TEXT
            if head.startswith(OPEN):
                self._buf = head  # no content before a call that opens the output
            return decided == "no"
        if self.state == _AFTER:
            return self._step_after(buf)
        if self.state == _CALL:
            return self._step_call(buf, content, calls)
        at = buf.find(OPEN)
        if at >= 0:
            content.append(buf[:at])
            self._buf = buf[at + len(OPEN):]
            self.state = _CALL
            return True
        keep = partial_suffix(buf, OPEN)
        content.append(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _step_after(self, buf: str) -> bool:
        """Whitespace between calls, or after the last, is dropped; text after a call keeps its spacing."""
        head = buf.lstrip()
        if not head or (len(head) < len(OPEN) and OPEN.startswith(head)):
            return False  # only whitespace, or a piece of the next tag: wait
        self._buf = head if head.startswith(OPEN) else buf
        self.state = _TEXT
        return True

    def _step_call(self, buf: str, content: list[str], calls: list[ToolCall]) -> bool:
        at = buf.find(CLOSE)
        while at >= 0 and _in_string(buf[:at]):  # "</tool_call>" written inside an argument
            at = buf.find(CLOSE, at + 1)
        if at < 0:
            return False
        call = parse_tagged(buf[:at].strip(), self.names)
        if call is None:
            content.append(OPEN + buf[:at + len(CLOSE)])
        else:
            calls.append(call)
        self._buf = buf[at + len(CLOSE):]
        self.state = _AFTER if call else _TEXT
        return True


def split_all(plan: ToolPlan, text: str) -> tuple[str, list[ToolCall]]:
    """Non-streaming: (content, calls) of a whole output."""
    parser = ToolCallParser(plan)
    c1, k1 = parser.feed(text)
    c2, k2 = parser.finish()
    return c1 + c2, k1 + k2
