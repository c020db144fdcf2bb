"""Structured outputs as vLLM's default backend reads them: a regex's \\d and \\w are ASCII
(regex_ascii.py), and a JSON schema's objects are closed unless it opens them (closed_objects)."""

from __future__ import annotations

import re

import pytest

from engine_utils import make_engine
from specserve.bench.structured_cases import run_cases
from specserve.engine.types import SamplingParams
from specserve.server.regex_ascii import ascii_classes, lark_ascii
from specserve.errors import RequestError
from specserve.server.json_schema import closed_objects
from specserve.server.structured import build_tokenizer, grammar_source, text_format_source


@pytest.mark.parametrize("regex, want", [
    (r"\d{4}-\d{2}", "[0-9]{4}-[0-9]{2}"),
    (r"[\d.]+\w", "[0-9.]+[0-9A-Za-z_]"),
    (r"[^\w\s]\D\W", r"[^0-9A-Za-z_\s][^0-9][^0-9A-Za-z_]"),
    (r"\\d", r"\\d"),  # an escaped backslash, then a d
    (r"[[:alpha:]\D]", "[[:alpha:][:^digit:]]"),
    (r"[]\d]\.", r"[]0-9]\."),
])
@pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")  # Python's re on "[[:", not ours
def test_ascii_classes(regex, want):
    assert ascii_classes(regex) == want
    for s in ("2024-05", "a.b", "x", "%", "٣", "🯸"):  # what Python's re.ASCII reads the same way
        assert bool(re.fullmatch(ascii_classes(regex), s)) == bool(re.fullmatch(regex, s, re.ASCII)), s


def test_lark_regex_terminals_only():
    g = 'start: /\\d{4}/ " /\\d" num // a /\\d/ comment\nnum: /[\\d\\/]+/i\n'
    assert lark_ascii(g) == 'start: /[0-9]{4}/ " /\\d" num // a /\\d/ comment\nnum: /[0-9\\/]+/i\n'
    gbnf = 'root ::= [0-9]+ "/" # a comment /\\d/\n'
    assert lark_ascii(gbnf) == gbnf


def test_strict_closes_every_object_schema():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},  # a property named so
        "type": {"type": "string"},
        "items": {"type": "array", "items": {"properties": {"b": {"type": "string"}}}},
        "open": {"type": "object", "additionalProperties": True}},
        "$defs": {"X": {"type": ["object", "null"]}}, "anyOf": [{"type": "object"}]}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert set(props) == {"properties", "type", "items", "open"}  # no property added
    assert props["properties"]["additionalProperties"] is False and "additionalProperties" not in props["type"]
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert out["$defs"]["X"]["additionalProperties"] is False and out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy


def test_every_json_schema_closes_its_objects_unless_it_opens_them():
    """As xgrammar (vLLM's default, strict or not) and llama.cpp: objects take only their listed keys
    by default; additionalProperties true opens one; json_object stays any object; true is any value."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert grammar_source("json", point).schema["additionalProperties"] is False
    assert grammar_source("json", {**point, "additionalProperties": True}).schema["additionalProperties"] is True
    fmt = {"type": "json_schema", "name": "p", "schema": point, "strict": False}
    assert text_format_source(fmt).schema["additionalProperties"] is False
    assert text_format_source({"type": "json_object"}).schema == {"type": "object"}
    assert grammar_source("json", True).schema == {} and grammar_source("json", "true").schema == {}
    with pytest.raises(RequestError, match="accepts no value"):
        grammar_source("json", False)
    with pytest.raises(RequestError, match="needs name") as exc:  # as OpenAI's Responses API
        text_format_source({"type": "json_schema", "schema": point})
    assert exc.value.param == "text.format.name"


def test_formats_llguidance_lacks_are_annotations():
    """Pydantic writes format path, binary, password; OpenAPI int64: JSON Schema lets a validator
    ignore a format it does not know (xgrammar and llama.cpp do), so these compile as plain strings
    instead of failing the request; the formats llguidance has stay."""
    schema = {"type": "object", "properties": {"p": {"type": "string", "format": "path"},
                                               "d": {"type": "string", "format": "date"},
                                               "n": {"type": "array", "items": {"type": "string", "format": "int64"}}},
              "additionalProperties": {"type": "string", "format": "binary"}}
    out = grammar_source("json", schema).schema
    assert "format" not in out["properties"]["p"] and out["properties"]["d"]["format"] == "date"
    assert "format" not in out["properties"]["n"]["items"] and "format" not in out["additionalProperties"]
    assert schema["properties"]["p"]["format"] == "path"  # the request's own schema is left as it was


def test_a_small_model_writes_ascii_digits_and_no_extra_keys():
    """smollm2-135m under \\d{4}-\\d{2}-\\d{2} read as Unicode digits wrote '🯸🯸🯸🯸-🯸🯸-🯸🯸' (an emoji's
    first bytes, then the segmented digit they allow); with strict, a date schema got an "author"."""
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "2")
    lltok, _ = build_tokenizer(engine.tokenizer)
    date = {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]}
    cases = [("regex", "date", "What's the date today?", r"\d{4}-\d{2}-\d{2}"),
             ("json", "strict", "Who first orbited the Earth, and when? Answer in JSON.", closed_objects(date))]
    (toks, _), (jtoks, _) = run_cases(engine, lltok, cases, SamplingParams(max_tokens=40))
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", engine.tokenizer.decode(toks))
    import json
    assert set(json.loads(engine.tokenizer.decode(jtoks))) == {"date"}
