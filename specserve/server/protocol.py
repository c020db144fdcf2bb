"""Request models and error bodies of the OpenAI-compatible API.

Requests are validated with pydantic: unknown fields are accepted (OpenAI clients send
extras) and kept in ``model_extra``, where the serving layer refuses those that would change
the result if ignored (vLLM's guided decoding, beam search, ...; ``serving.check_unsupported``)
and logs the rest; wrong types are rejected with a 400 whose
``param`` names the offending field. Responses are built as plain dicts by the
serving modules; this module only fixes their error shape.
"""

from __future__ import annotations

import json
import re
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from starlette.responses import JSONResponse

from specserve.errors import RequestError


class ApiError(Exception):
    """An error with an HTTP status other than 400 (or a 400 with a specific type/code)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def request_error_response(exc: RequestError) -> JSONResponse:
    return error_response(400, str(exc), param=exc.param, code=exc.code)


# ---------------------------------------------------------------- validation errors

_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before",
              "function-wrap", "function-plain", "model", "json-or-python", "lax-or-strict"}


def loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; drops 'body' and union-member tags.

    The first part is always a field of the request (even one named 'model');
    later parts that name a union member ('str', 'list[int]', 'ChatMessage') are dropped.
    """
    out = ""
    for part in loc:
        text = str(part)
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "body" and not out:
            continue
        elif out and (text in _TYPE_TAGS or text[:1].isupper() or not (text.isidentifier() or text.isdigit())):
            continue
        else:
            out += f".{text}" if out else text
    return out or None


def _depth(err: dict) -> int:
    param = loc_to_param(tuple(err.get("loc", ())))
    return 0 if param is None else param.count(".") + param.count("[") + 1


def validation_error(errors: list[dict]) -> RequestError:
    """The most specific pydantic error as a RequestError with the field as param.

    A union (``content``: a string or a list of parts) fails once per member;
    the error that got deepest into the value names the field that is wrong.
    """
    if not errors:
        return RequestError("invalid request body")
    err = max(errors, key=_depth)  # max keeps the first of equals
    if err.get("type") == "json_invalid":
        return RequestError(f"invalid JSON body: {err.get('msg', '')}", code="invalid_json")
    param = loc_to_param(tuple(err.get("loc", ())))
    msg = err.get("msg", "invalid value")
    if err.get("type") == "value_error":  # a validator's own message, without pydantic's "Value error, "
        msg = msg.removeprefix("Value error, ")
    if err.get("type") == "missing":
        return RequestError(f"missing required field '{param}'", param=param)
    return RequestError(f"invalid value for '{param}': {msg}" if param else msg, param=param)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(obj: Any, path: str) -> str | None:
    """The path (OpenAI param style) of the first string that cannot be UTF-8 encoded, or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(key, str) and _lone_surrogate(key, path) is not None:
            return path or "body"
        sub = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found = _lone_surrogate(value, sub)
        if found is not None:
            return found
    return None


def _decode_json(raw: bytes) -> Any:
    """Bytes -> JSON value. Strict UTF-8 (or the UTF-16/32 json.loads detects): encoded surrogates
    (b"\\xed\\xa0\\x80"), which json.loads(bytes) lets through, are not text."""
    if not raw:
        return None
    try:
        text = raw.decode(json.detect_encoding(raw))
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid UTF-8: {exc}", code="invalid_json") from exc
    try:
        return json.loads(text.removeprefix("\ufeff"))
    except RecursionError as exc:
        raise RequestError("invalid JSON body: nested too deeply", code="invalid_json") from exc
    except ValueError as exc:
        why = "an integer literal has too many digits" if "int_max_str_digits" in str(exc) else str(exc)
        raise RequestError(f"invalid JSON body: {why}", code="invalid_json") from exc


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> validated request model, or RequestError."""
    obj = _decode_json(raw)
    if not isinstance(obj, dict):
        raise RequestError("request body must be a JSON object", code="invalid_json")
    try:
        if _SURROGATE_ESCAPE.search(raw):  # "\ud83d\ude00" pairs are fine; a lone half is not text
            bad = _lone_surrogate(obj, "")
            if bad is not None:
                raise RequestError(f"invalid string in '{bad}': a lone UTF-16 surrogate escape (not valid "
                                   "Unicode)", param=bad, code="invalid_json")
        return model.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from exc
    except RecursionError as exc:
        raise RequestError("invalid JSON body: nested too deeply", code="invalid_json") from exc


# ---------------------------------------------------------------- request models

def _is_int_field(annotation: Any) -> bool:
    """int or int | None (not a union with float or str, where a float must stay a float)."""
    if annotation is int:
        return True
    args = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    return int in args and all(a in (int, type(None)) for a in args)


class _Lenient(BaseModel):
    """Unknown fields are ignored; types are strict (true is not 1, "2" is not 2), except that a
    null means the field's default and an integral float (16.0, from float-only clients) is an int."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_integral_floats(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = {}
        for key, value in data.items():
            field = cls.model_fields.get(key)
            if field is not None and value is None and not field.is_required():
                continue  # null: the default
            if field is not None and type(value) is float and value.is_integer() and _is_int_field(field.annotation):
                value = int(value)
            out[key] = value
        return out


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk too (with include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_calls, tool_call_id, reasoning_content ...
    role: str
    content: str | list[ContentPart] | None = None


class ResponseFormat(_Lenient):
    type: str
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"} (server/structured.py)


class SamplingFields(_Lenient):
    """Fields shared by chat and completions requests (unknown ones land in ``model_extra``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's: the response's prompt_logprobs, top n per prompt token


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False  # with logprobs: the prompt's tokens and logprobs first (prompt logprobs)
    prompt_logprobs: int | None = None  # vLLM's: the choice's prompt_logprobs, top n per prompt token
    suffix: str | None = None  # the text after the insertion: the prompt is the text before it (infill)


class ExtraFile(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    filename: str = "tmp"
    text: str = ""


class NativeFields(SamplingFields):
    """llama-server's own fields of /completion and /infill (its others are ignored, as there)."""

    n_predict: int = -1  # -1: until the context is full (llama-server's default)
    repeat_penalty: float | None = None
    n_indent: int = 0  # end before a line indented less than this many whitespace characters (0: off)
    t_max_predict_ms: float = 0  # end once this long after the first token, at a new line (0: off)
    n_probs: int = 0  # the top n_probs tokens' logprobs of each generated token (completion_probabilities)
    post_sampling_probs: bool = False  # probabilities after the samplers: not supported (a 400)
    return_tokens: bool = False  # the generated token ids in the answer's "tokens"
    response_fields: list[str] = []  # the final answer keeps only these paths ("timings/prompt_n"), flat
    # OpenAI's {"id": bias}, or llama-server's [[id or text, bias or false], ...] (serving_infill)
    logit_bias: dict[str, float] | list[list[Any]] | None = None


class InfillRequest(NativeFields):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = []
    prompt: str = ""


class NativeCompletionRequest(NativeFields):
    prompt: str | list[int] | list[str | list[int]]  # several: texts and/or token-id lists

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and any(isinstance(t, int) for t in value) and \
                any(not isinstance(t, int) or isinstance(t, bool) for t in value):
            raise ValueError("a prompt is a string or a list of token ids, and several prompts a list of "
                             "those (texts and token ids mixed in one prompt are not supported)")
        return value


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    content: str | None = None  # llama-server's name for prompt (with add_special, default false, and with_pieces)
    add_special: bool = False
    parse_special: bool = True  # llama-server's: false reads special tokens' spellings as plain text
    with_pieces: bool = False
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered as chat renders them: the same count


class ApplyTemplateRequest(_Lenient):
    """llama-server's /apply-template: the chat template's fields of a chat request."""

    model: str | None = None
    messages: list[ChatMessage] | None = None  # required (checked by the endpoint, naming the field)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]
