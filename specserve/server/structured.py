"""Structured outputs: the request fields that constrain what is generated, compiled to grammars.

Fields, as OpenAI and vLLM take them (at most one per request):

* ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}}`` (the schema is always enforced, ``strict`` or not);
* vLLM's ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice`` (a list of
  strings), ``grammar`` (Lark or GBNF), ``json_object: true``; and ``whitespace_pattern``
  (a regex's ``\\d`` and ``\\w`` are ASCII, as in xgrammar: regex_ascii.py);
* vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
  (and ``guided_whitespace_pattern``);
* llama-server's ``grammar`` (GBNF) and ``json_schema`` (a schema), on chat, completions and its own endpoints;
* ``tool_choice: "required"`` or a named function: the output is the tool-call text the hermes
  parser reads, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, with the
  arguments constrained by the tool's parameter schema, its objects closed (``closed_objects``:
  a key the function does not take is never written, as OpenAI's strict tools and xgrammar do).

Every JSON schema's objects are closed where the schema does not open them (``closed_objects``:
``additionalProperties: false``), as vLLM's default backend (xgrammar's strict mode) and llama.cpp's
schema converter take them: otherwise a small model writes key after key until max_tokens cuts the
JSON short. ``additionalProperties: true`` (or a schema for them) opens an object. A schema
``true`` (or ``{}``) is any JSON value.

Grammars are compiled by llguidance (no dependencies, a 3 MB wheel; its Earley parser computes
masks lazily, so a schema's compile is cheap and bounded by its parser limits) in a worker
thread, with a time limit: a compile that runs past it is a 400 while the event loop keeps
serving, and its result, when it finishes, is cached for the next request. Compiled grammars
are kept in an LRU cache keyed by the grammar text (errors too: a bad schema sent again is
refused at once). JSON is written without free whitespace
(``", "`` and ``": "`` separators, as ``json.dumps``), which keeps a small model from padding
its output with blank lines forever; a whitespace pattern turns free whitespace back on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from specserve.engine.constraint import ConstraintSpec, Grammar
from specserve.errors import RequestError
from specserve.server.json_schema import prepared
from specserve.server.regex_ascii import ascii_classes, lark_ascii
from specserve.server.tools import CLOSE, OPEN, ToolPlan

CACHE_SIZE = 256  # compiled grammars kept
WORKERS = 2  # compile threads: a compile past the time limit keeps its thread until it ends
MESSAGE_LIMIT = 400  # characters of a compiler error quoted in a 400
KEYWORD_ROUNDS = 8  # re-checks of a schema to list all its unsupported keywords
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_OLD = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
LITERAL_TAGS = (json.dumps(OPEN), json.dumps(CLOSE))  # the tool-call tags as text, in Lark
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


@dataclass(frozen=True)
class Source:
    """What one request asks the output to match, as llguidance grammar text."""

    grammar: str
    param: str  # the request field, for errors
    what: str  # "JSON schema", "regex", ... (for messages)
    schema: Any = field(default=None, compare=False)  # a JSON schema's own value (to list what it lacks)


def start_for(reasoning_parser: str, prompt_opened: bool) -> str:
    """Where the grammar starts (engine/constraint.py): after the reasoning when the output begins
    inside a <think> block, at once without a reasoning parser."""
    if reasoning_parser == "none":
        return "now"
    if reasoning_parser == "deepseek_r1" or prompt_opened:
        return "after_think"
    return "maybe_think"


# ---------------------------------------------------------------- request fields -> grammar text

def requested_source(req: Any, tools: ToolPlan | None = None, tags: tuple[str, str] = LITERAL_TAGS,
                     also: Source | None = None) -> Source | None:
    """The constraint a request asks for, or None: a chat or completions request's fields (``req``
    None: none), a forced tool choice, and ``also`` (the Responses API's text.format); more than
    one is a 400. ``tags``: the tool-call tags as Lark terms (see :func:`tag_terms`)."""
    found = [] if req is None else _field_sources(req)
    if also is not None:
        found.append(also)
    if tools is not None and tools.forced:
        found.append(_from_tools(tools, tags))
    if len(found) > 1:
        raise RequestError(f"{found[1].param} and {found[0].param} both constrain the output; send one",
                           param=found[1].param)
    return found[0] if found else None


def _field_sources(req: Any) -> list[Source]:
    """The constraints of a chat or completions request's own fields."""
    extra = req.model_extra or {}
    found: list[Source] = []
    fmt = req.response_format
    if fmt is not None and fmt.type in ("json_object", "json_schema"):
        found.append(_from_response_format(fmt))
    if extra.get("structured_outputs") is not None:
        found.append(_from_structured_outputs(extra["structured_outputs"]))
    ws = _whitespace(extra.get("guided_whitespace_pattern"), "guided_whitespace_pattern")
    for name in _OLD:
        if extra.get(name) is not None:
            found.append(grammar_source(name.removeprefix("guided_"), extra[name], name, ws))
    # llama-server's own: a GBNF grammar, a JSON schema (an empty grammar is none, as there)
    if extra.get("grammar") not in (None, ""):
        found.append(grammar_source("grammar", extra["grammar"], "grammar"))
    if extra.get("json_schema") is not None:
        found.append(grammar_source("json", extra["json_schema"], "json_schema"))
    return found


def text_format_source(fmt: Any) -> Source | None:
    """The Responses API's ``text.format``: ``{"type": "text"}`` (None), ``{"type": "json_object"}``
    or ``{"type": "json_schema", "name": ..., "schema": {...}, "strict": ...}`` (flat, unlike chat's
    response_format). Raises RequestError."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return _json({"type": "object"}, "text.format", None, closed=False)
    if kind != "json_schema":
        raise RequestError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                           param="text.format.type")
    if "schema" not in fmt:
        raise RequestError("text.format json_schema needs schema (a JSON Schema object)", param="text.format.schema")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:  # as OpenAI's
        raise RequestError("text.format json_schema needs name (a string)", param="text.format.name")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise RequestError("text.format.strict must be a boolean", param="text.format.strict")
    return _json(fmt["schema"], "text.format.schema", None)


def _from_response_format(fmt: Any) -> Source:
    if fmt.type == "json_object":
        return _json({"type": "object"}, "response_format", None, closed=False)
    spec = fmt.json_schema
    if not isinstance(spec, dict) or "schema" not in spec:
        raise RequestError("response_format json_schema needs json_schema.schema (a JSON Schema object)",
                           param="response_format.json_schema.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("response_format.json_schema.strict must be a boolean",
                           param="response_format.json_schema.strict")
    return _json(spec["schema"], "response_format.json_schema.schema", None)


def _from_structured_outputs(value: Any) -> Source:
    if not isinstance(value, dict):
        raise RequestError("structured_outputs must be an object", param="structured_outputs")
    if value.get("structural_tag") is not None:
        raise RequestError("structured_outputs.structural_tag is not supported", param="structured_outputs")
    ws = _whitespace(value.get("whitespace_pattern"), "structured_outputs.whitespace_pattern")
    kinds = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if value.get("json_object"):
        kinds.append("json_object")
    if len(kinds) != 1:
        raise RequestError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
                           f"{'' if not kinds else ', got ' + ', '.join(kinds)}", param="structured_outputs")
    kind = kinds[0]
    if kind == "json_object":
        return _json({"type": "object"}, "structured_outputs.json_object", ws, closed=False)
    return grammar_source(kind, value[kind], f"structured_outputs.{kind}", ws)


def grammar_source(kind: str, value: Any, param: str | None = None, ws: str | None = None) -> Source:
    """The grammar of one kind of constraint: "json" (a schema), "regex", "choice" (a list of
    strings) or "grammar" (Lark or GBNF). Raises RequestError for a malformed value."""
    import llguidance

    param = param or kind

    if kind == "json":
        return _json(value, param, ws)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise RequestError(f"{param} must be a non-empty string (a regular expression)", param=param)
        return Source(llguidance.LLMatcher.grammar_from_regex(ascii_classes(value)), param, "regex")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
        return Source(llguidance.grammar_from("choice", value), param, "choice")
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{param} must be a non-empty string (a Lark or GBNF grammar)", param=param)
    try:
        return Source(llguidance.grammar_from("grammar", lark_ascii(value)), param, "grammar")
    except ValueError as exc:
        raise RequestError(f"{param}: {_short(str(exc))}", param=param) from None


def _schema(value: Any, param: str) -> dict | bool:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise RequestError(f"{param} is not valid JSON", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise RequestError(f"{param} must be a JSON Schema (an object)", param=param)
    return value


def _json(value: Any, param: str, ws: str | None, closed: bool = True) -> Source:
    """A JSON schema's grammar; ``closed``: its objects closed where it does not open them (module
    docstring), False for json_object's any object."""
    import llguidance

    options = COMPACT if ws is None else {"whitespace_flexible": True, "whitespace_pattern": ws}
    try:
        schema = prepared(_schema(value, param), closed)
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"{param}: {_short(str(exc))}", param=param) from None
    return Source(text, param, "JSON schema", schema)


def _whitespace(value: Any, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{param} must be a string (a regular expression)", param=param)
    return value


def tag_terms(backend, lltok) -> tuple[str, str]:
    """<tool_call> and </tool_call> as Lark terms: the tokenizer's own token where it is a special
    token (llguidance matches a special token only as itself, never as the text it spells), else
    the text."""
    terms = []
    for tag in (OPEN, CLOSE):
        tid = backend.token_to_id(tag)
        terms.append(f"<[{tid}]>" if tid is not None and lltok.is_special_token(tid) else json.dumps(tag))
    return terms[0], terms[1]


def _from_tools(plan: ToolPlan, tags: tuple[str, str]) -> Source:
    """Calls in the hermes format, each naming one of the forced tools with arguments that match
    its parameters; several calls (one per line) when parallel calls are allowed."""
    import llguidance

    calls = []
    for tool in plan.template_tools or []:
        fn = tool["function"]
        if fn["name"] in plan.forced:
            params = fn.get("parameters")  # closed: a key the function does not take would break its call
            try:
                args = prepared({"type": "object", "properties": {}} if params is None else params)
            except ValueError as exc:
                raise RequestError(f"tool {fn['name']!r}: parameters: {exc}", param="tools") from None
            calls.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": args},
                          "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    body = json.dumps({**schema, "x-guidance": COMPACT})
    # a newline may close the calls (a model often writes one before its end token)
    calls_rule = 'call ("\\n" call)* "\\n"?' if plan.parallel else 'call "\\n"?'
    lark = f'start: {calls_rule}\ncall: {tags[0]} "\\n" body "\\n" {tags[1]}\nbody: %json {body}\n'
    return Source(llguidance.LLMatcher.grammar_from_lark(lark), "tool_choice", "tool parameters")


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MESSAGE_LIMIT else message[:MESSAGE_LIMIT] + " ..."


def explain(error: str, source: Source) -> str:
    """llguidance's error as a message naming the request field (and the unsupported keywords)."""
    keys = _UNIMPLEMENTED.search(error)
    if keys:
        names = json.loads(f"[{keys.group(1)}]")
        if source.schema is not None:
            names = unsupported_keywords(source.schema, names)
        return f"{source.param}: unsupported JSON Schema keywords: {', '.join(names)}"
    return f"{source.param}: invalid {source.what}: {_short(error)}"


def unsupported_keywords(schema: Any, found: list[str]) -> list[str]:
    """Every keyword of ``schema`` llguidance does not implement, not only the first it meets
    (``found``): the schema is checked again without the keywords found so far, a few rounds."""
    import llguidance

    names = list(found)
    for _ in range(KEYWORD_ROUNDS):
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(_without(schema, frozenset(names)))
            more = _UNIMPLEMENTED.search(llguidance.LLMatcher.validate_grammar(grammar) or "")
        except (ValueError, RecursionError):
            break
        new = [n for n in json.loads(f"[{more.group(1)}]") if n not in names] if more else []
        if not new:
            break
        names += new
    return names


def _without(value: Any, keys: frozenset[str]) -> Any:
    """``value`` with the object keys ``keys`` removed at every depth."""
    if isinstance(value, dict):
        return {k: _without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_without(v, keys) for v in value]
    return value


# ---------------------------------------------------------------- compiling, cached

class StructuredOutputs:
    """Compiles the grammars of one server's requests: worker threads (llguidance drops the GIL
    while it builds), a time limit per request, an LRU cache. A compile that outlives its
    request's limit runs on (it cannot be stopped; llguidance's limits bound it) and caches its
    result; a request for the same grammar meanwhile waits on that compile, not a new one."""

    def __init__(self, tokenizer, timeout_s: float, cache_size: int = CACHE_SIZE):
        self.source_tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Grammar | str] = OrderedDict()  # str: the compile error
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lltok = None
        self.think_open: tuple[int, ...] = ()
        self.tags = LITERAL_TAGS  # the tool-call tags in Lark, set with the tokenizer

    async def spec_for(self, req: Any, tools: ToolPlan | None = None, start: str = "now",
                       also: Source | None = None) -> ConstraintSpec | None:
        """The request's constraint (compiled, or from the cache), or None: see
        :func:`requested_source`. Raises RequestError."""
        if tools is not None and tools.forced:
            await self._ready("tool_choice")  # the tags' terms depend on the tokenizer
        source = requested_source(req, tools, self.tags, also)
        if source is None:
            return None
        grammar = await self.compile(source)
        return ConstraintSpec(grammar, start, self.think_open if start == "maybe_think" else ())

    async def compile(self, source: Source) -> Grammar:
        pool = self._worker()
        await self._ready(source.param)
        with self._lock:
            hit = self._cache.get(source.grammar)
            if hit is not None:
                self._cache.move_to_end(source.grammar)
            future = self._pending.get(source.grammar)
            if hit is None and future is None:
                future = pool.submit(self._build, source.grammar)
                self._pending[source.grammar] = future
        if hit is None:
            try:
                hit = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
            except asyncio.TimeoutError:
                raise RequestError(f"{source.param}: compiling the {source.what} took longer than "
                                   f"{self.timeout_s:g} s (--grammar-compile-timeout); simplify it",
                                   param=source.param) from None
        if isinstance(hit, str):
            raise RequestError(explain(hit, source), param=source.param)
        return hit

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- worker thread ---------------------------------------------------------------------
    async def _ready(self, param: str) -> None:
        """Build the llguidance tokenizer once, outside any time limit (seconds for a 150K vocabulary:
        every token's bytes, a text-only tokenizer); a model without a tokenizer.json gets a 400
        naming ``param``."""
        if self._lltok is None:
            try:
                await asyncio.wrap_future(self._worker().submit(self._tokenizer))
            except RequestError as exc:
                raise RequestError(str(exc), param=param) from None

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="specserve-grammar")
        return self._pool

    def _tokenizer(self):
        if self._lltok is None:
            lltok, self.think_open = build_tokenizer(self.source_tokenizer)
            self.tags = tag_terms(self.source_tokenizer.backend, lltok)
            self._lltok = lltok
        return self._lltok

    def _build(self, grammar: str) -> Grammar | str:
        """Compile (and warm: the first mask builds the lexer) one grammar; an error is returned as
        its message. The result is cached whether or not the request that asked still waits."""
        try:
            result = compile_grammar(self._lltok, grammar)
        except Exception as exc:  # noqa: BLE001 - reported to the request as a 400, never a stuck entry
            result = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._pending.pop(grammar, None)
            self._cache[grammar] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result


def compile_grammar(lltok, grammar: str) -> Grammar | str:
    """Compile grammar text for a tokenizer (and warm it: the first mask builds the lexer);
    an error comes back as llguidance's message."""
    import llguidance

    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher.get_error() if matcher.is_error() else Grammar(matcher, lltok)


def parser_limits():
    """llguidance's resource limits (its defaults), with short error messages."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


class _Vocabulary:
    """The model's vocabulary as llguidance reads it (its TokenizerWrapper): every token's bytes, the
    added tokens as special ones, and a tokenizer of text alone. Given the tokenizer.json instead,
    llguidance tokenized the text a grammar forces with the added tokens read in it: the forced text
    "<tool_call>" became the special token, which its own matcher then refused (the answer ended
    there, marked stop)."""

    def __init__(self, tokenizer):
        self.tokens = tokenizer.all_token_bytes()
        self.special_token_ids = sorted(tokenizer.backend.get_added_tokens_decoder())
        self.eos_token_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self._text = tokenizer.text_only()

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance then passes text (the valid UTF-8 it holds) as str
            raise TypeError("text only")
        return self._text.encode(text, add_special_tokens=False).ids


def build_tokenizer(tokenizer) -> tuple[Any, tuple[int, ...]]:
    """An llguidance tokenizer over the model's tokenizer.json (specserve.models.tokenizer), with
    the model's end-of-generation tokens as EOS; and the token ids that open a <think> block."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise RequestError("structured outputs need the model's tokenizer (a tokenizer.json); this one has none")
    try:
        lltok = llguidance.LLTokenizer(TokenizerWrapper(_Vocabulary(tokenizer)), n_vocab=tokenizer.vocab_size,
                                       eos_token=sorted(tokenizer.eos_token_ids))
    except ValueError as exc:  # a vocabulary llguidance cannot read: the request's error, not a 500
        raise RequestError(f"structured outputs cannot use this model's tokenizer: {exc}") from None
    think = backend.token_to_id("<think>")
    return lltok, (() if think is None else (think,))


def constrain(choices: list, spec: ConstraintSpec | None) -> list:
    """The choices with the constraint in their sampling parameters."""
    if spec is not None:
        for c in choices:
            c.params = replace(c.params, structured=spec)
    return choices
