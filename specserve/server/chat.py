"""Chat messages -> prompt text: validation, template kwargs merging, rendering."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from jinja2 import TemplateError

from specserve.errors import RequestError, SpecserveError
from specserve.models.chat_template import ChatTemplate
from specserve.server.media import IMAGE_MARK, IMAGE_PART_TYPES, image_url_of
from specserve.server.protocol import ChatMessage
from specserve.server.tools import history_tool_calls

logger = logging.getLogger("specserve.server")

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = ("text", "input_text")
# names the renderer sets itself; a request may not replace them through chat_template_kwargs
RESERVED_KWARGS = ("messages", "tools", "bos_token", "eos_token")
CONTINUE_MARK = "\ue000continue\ue000"  # private-use characters: where an open assistant turn's text ends
THINK_OPEN = "<think>"

# a tool no template would print by accident: its name in the rendering shows the template writes tools
PROBE_TOOL = {"type": "function", "function": {"name": "specserve_probe_tool_7f3a", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}
NO_TOOLS_MESSAGE = ("the chat template of {model!r} does not render tools, so the model would never see them; "
                    "start the server with --chat-template FILE naming a template that renders `tools`, or "
                    "send tool_choice \"none\"")

NO_TEMPLATE_MESSAGE = ("model {model!r} has no chat template, so /v1/chat/completions cannot build a prompt; "
                       "start the server with --chat-template FILE or send raw text to /v1/completions")


class ChatRenderer:
    """Compiles the chat template once and renders validated messages with it.

    ``override`` (from --chat-template) replaces the model's template. A broken
    override fails at startup; a broken model template only disables chat.
    """

    def __init__(self, model_template: str | None, override: str | None, bos_token: str | None,
                 eos_token: str | None, defaults: Mapping[str, Any], model_name: str):
        self.defaults = dict(defaults)
        self.model_name = model_name
        self.template: ChatTemplate | None = None
        self.broken: str | None = None
        if override is not None:
            try:
                self.template = ChatTemplate(override, bos_token, eos_token)
            except TemplateError as exc:
                raise SpecserveError(f"--chat-template does not compile: {exc}") from exc
        elif model_template:
            try:
                self.template = ChatTemplate(model_template, bos_token, eos_token)
            except TemplateError as exc:
                self.broken = str(exc)
                logger.warning("the model's chat template does not compile (%s); chat is disabled", exc)
        self.renders_tools = self._renders_tools()
        if self.template is not None and not self.renders_tools:
            logger.info("the chat template does not render tools: requests with tools get a 400")

    def _renders_tools(self) -> bool:
        """Whether the template writes a request's ``tools`` into the prompt: render one user turn with a
        probe tool, once at start-up (by what the template does, not by its name). A template that
        fails on the probe but not without it cannot render tools either."""
        if self.template is None:
            return False
        msgs = [{"role": "user", "content": "Hi"}]
        kwargs = {k: v for k, v in self.defaults.items() if k not in (*RESERVED_KWARGS, "add_generation_prompt")}
        try:
            self.template.render(msgs, add_generation_prompt=True, tools=None, **kwargs)
        except Exception:  # noqa: BLE001 - cannot tell: do not refuse tools for it
            return True
        try:
            text = self.template.render(msgs, add_generation_prompt=True, tools=[PROBE_TOOL], **kwargs)
        except Exception:  # noqa: BLE001
            return False
        return PROBE_TOOL["function"]["name"] in text

    def render(self, messages: list[ChatMessage], request_kwargs: Mapping[str, Any] | None = None,
               add_generation_prompt: bool = True, tools: list[dict] | None = None,
               continue_final: bool = False) -> str:
        """The prompt text. continue_final (vLLM's continue_final_message): the last message, an
        assistant turn, is left open so the model continues its text (a prefill): the rendering
        ends where that message's text ends, before the template closes the turn."""
        if continue_final:
            return self._render_open(messages, request_kwargs, tools)
        return self._render(messages, request_kwargs, add_generation_prompt, tools)

    def _render_open(self, messages: list[ChatMessage], request_kwargs: Mapping[str, Any] | None,
                     tools: list[dict] | None) -> str:
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or not isinstance(last.content, str):
            raise RequestError("continue_final_message needs a last message from the assistant with text "
                               "content", param="messages")
        marked = last.model_copy(update={"content": last.content + CONTINUE_MARK})
        text = self._render([*messages[:-1], marked], request_kwargs, False, tools)
        at = text.rfind(CONTINUE_MARK)
        if at < 0:
            raise RequestError("continue_final_message: the chat template does not write the last message's "
                               "text as given", param="messages")
        return text[:at]

    def _render(self, messages: list[ChatMessage], request_kwargs: Mapping[str, Any] | None,
                add_generation_prompt: bool, tools: list[dict] | None) -> str:
        if self.template is None:
            if self.broken:
                raise RequestError(f"the model's chat template does not compile ({self.broken}); "
                                   "start the server with --chat-template FILE", param="messages",
                                   code="chat_template_error")
            raise RequestError(NO_TEMPLATE_MESSAGE.format(model=self.model_name), param="messages",
                               code="no_chat_template")
        if tools and not self.renders_tools:
            raise RequestError(NO_TOOLS_MESSAGE.format(model=self.model_name), param="tools",
                               code="tools_not_supported")
        kwargs = merge_kwargs(self.defaults, request_kwargs)
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
        msgs = normalize_messages(messages)
        try:
            return self.template.render(msgs, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        except RequestError:
            raise
        except Exception as exc:  # a template's own logic failing on this input (TypeError, ...)
            raise RequestError(f"chat template error: {type(exc).__name__}: {exc}", param="messages") from exc


def merge_kwargs(defaults: Mapping[str, Any], request: Mapping[str, Any] | None) -> dict[str, Any]:
    """Server defaults overridden key by key by the request's chat_template_kwargs."""
    merged = dict(defaults)
    for key, value in (request or {}).items():
        if key in RESERVED_KWARGS:
            raise RequestError(f"chat_template_kwargs may not set {key!r}", param=f"chat_template_kwargs.{key}")
        merged[key] = value
    return merged


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validate roles and content; flatten text parts into one string per message."""
    if not messages:
        raise RequestError("messages must contain at least one message", param="messages")
    return [_normalize(i, m) for i, m in enumerate(messages)]


def _normalize(i: int, msg: ChatMessage) -> dict[str, Any]:
    if msg.role not in ROLES:
        raise RequestError(f"unknown role {msg.role!r} in messages[{i}]; expected one of {', '.join(ROLES)}",
                           param=f"messages[{i}].role")
    out: dict[str, Any] = dict(msg.model_extra or {})
    out["role"] = "system" if msg.role == "developer" else msg.role
    out["content"] = _content_text(i, msg)
    if msg.role == "assistant" and out.get("tool_calls") is not None:
        out["tool_calls"] = history_tool_calls(i, out["tool_calls"])
    return out


def _content_text(i: int, msg: ChatMessage) -> str | None:
    content = msg.content
    if content is None:
        if msg.role == "assistant":
            return ""  # e.g. a turn that only made tool calls; templates concatenate content
        raise RequestError(f"messages[{i}] ({msg.role}) has no content", param=f"messages[{i}].content")
    if isinstance(content, str):
        return content.replace(IMAGE_MARK, "")
    out, prev_text = "", False
    for j, part in enumerate(content):
        if part.type in IMAGE_PART_TYPES:  # the image's place: its tokens replace the mark (server/media.py)
            out, prev_text = out + IMAGE_MARK, False
            continue
        text = _part_text(i, j, msg.role, part)
        out, prev_text = out + ("\n" if prev_text else "") + text.replace(IMAGE_MARK, ""), True
    return out


def _part_text(i: int, j: int, role: str, part) -> str:
    """A text part's text; in an assistant message also a refusal part's refusal (OpenAI's assistant
    content takes both; a conversation replayed with a refusal in it reads it as the turn's text)."""
    key = "refusal" if part.type == "refusal" and role == "assistant" else "text"
    if key == "text" and part.type not in TEXT_PART_TYPES:
        kinds = "text, refusal, image_url" if role == "assistant" else "text, image_url"
        raise RequestError(f"content part type {part.type!r} is not supported ({kinds})",
                           param=f"messages[{i}].content[{j}].type")
    text = part.text if key == "text" else (part.model_extra or {}).get("refusal")
    if not isinstance(text, str):
        raise RequestError(f"messages[{i}].content[{j}] ({part.type}) has no '{key}'",
                           param=f"messages[{i}].content[{j}].{key}")
    return text


def image_urls(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(url, where) of every image part, in prompt order."""
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg.content, list):
            for j, part in enumerate(msg.content):
                if part.type in IMAGE_PART_TYPES:
                    where = f"messages[{i}].content[{j}]"
                    out.append((image_url_of(part, where), where))
    return out


def prompt_opens_think(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open <think> block (the template opened it)."""
    return prompt.rstrip().endswith(THINK_OPEN)
