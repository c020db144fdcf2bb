"""Tool calling: request validation, the history's calls for templates, and the call parser
(whole text and streamed in pieces must give the same content and calls)."""

from __future__ import annotations

import json
import random

import pytest

from specserve.errors import RequestError
from specserve.server.tools import (ToolCallParser, ToolPlan, history_tool_calls, plan_tools, resolve_parser,
                                    split_all)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
PLAN = plan_tools([WEATHER, TIME], None, None, "hermes")

TAGGED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def calls_of(text: str, plan: ToolPlan = PLAN) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = split_all(plan, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(text: str, plan: ToolPlan = PLAN, seed: int = 0) -> tuple[str, list[tuple[str, dict]]]:
    """Feed the text in random pieces (1-6 characters), as deltas arrive."""
    rng, parser, content, calls, i = random.Random(seed), ToolCallParser(plan), "", [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        c, k = parser.feed(text[i:i + n])
        content, calls, i = content + c, calls + k, i + n
    c, k = parser.finish()
    return content + c, [(x.name, json.loads(x.arguments)) for x in calls + k]


CASES = [
    # (output, content, calls)
    (TAGGED, "", [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + TAGGED, "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    (TAGGED + "\n" + TAGGED.replace("Paris", "Oslo"), "",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', "", [("get_time", {})]),
    ('<tool_call>\n{"name": "get_time", "parameters": {"tz": "UTC"}}', "", [("get_time", {"tz": "UTC"})]),
    # bare JSON, a fence, a list: the way small models answer
    ('{"name": "get_weather", "arguments": {"city": "Tokyo"}}', "", [("get_weather", {"city": "Tokyo"})]),
    ('\n```json\n{\n  "name": "get_time",\n  "arguments": {}\n}\n```', "", [("get_time", {})]),
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]', "",
     [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    # not calls: stays content, byte for byte
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),
    ('{"name": "add_numbers", "arguments": {"a": 1}}', '{"name": "add_numbers", "arguments": {"a": 1}}', []),
    ('{"name": "get_time", "arguments": {}} and then some text',
     '{"name": "get_time", "arguments": {}} and then some text', []),
    ('```python\nprint(1)\n```', '```python\nprint(1)\n```', []),
    ("{}", "{}", []),
    ("a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
    ('<tool_call>{"name": "get_weather", "arguments": {broken</tool_call> ok',
     '<tool_call>{"name": "get_weather", "arguments": {broken</tool_call> ok', []),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', '<tool_call>{"name": "nope", "arguments": {}}'
     '</tool_call>', []),
    ("<tool_call>\n{\"name\": \"get_ti", "<tool_call>\n{\"name\": \"get_ti", []),  # cut off: text
    ('{"name": "get_time", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",
     '{"name": "get_time", "arguments": ' + "[" * 5000 + "]" * 5000 + "}", []),  # too deep for json: text
    # the closing tag inside an argument string does not end the call; escaped quotes stay inside strings
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "a \\"</tool_call>\\" b"}}</tool_call>', "",
     [("get_weather", {"city": 'a "</tool_call>" b'})]),
    ('<tool_call>{"name": "get_time", "arguments": {"tz": "</tool_call>"}}</tool_call> done', " done",
     [("get_time", {"tz": "</tool_call>"})]),
    ('<tool_call>{"name": "get_time", "arguments": {"tz": "\\\\"}}</tool_call>', "", [("get_time", {"tz": "\\"})]),
    # text around calls keeps its spacing; whitespace before the first and between calls does not count
    ("Sure." + TAGGED + "\nDone.", "Sure.\nDone.", [("get_weather", {"city": "Paris"})]),
    ("\n\n" + TAGGED + "\n\n", "", [("get_weather", {"city": "Paris"})]),
    (TAGGED + " <tool", " <tool", [("get_weather", {"city": "Paris"})]),
    # NaN / Infinity / 1e999 are no JSON for the client: not a call
    ('{"name": "get_time", "arguments": {"x": NaN}}', '{"name": "get_time", "arguments": {"x": NaN}}', []),
    ('<tool_call>{"name": "get_time", "arguments": {"x": 1e999}}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {"x": 1e999}}</tool_call>', []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse_whole_and_streamed(text, content, calls):
    assert calls_of(text) == (content, calls)
    for seed in range(5):
        assert streamed(text, seed=seed) == (content, calls)


def test_call_ids_are_unique_and_arguments_are_json_text():
    _, calls = split_all(PLAN, TAGGED + TAGGED)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].arguments == '{"city": "Paris"}'
    assert calls[0].as_dict(3) == {"index": 3, "id": calls[0].id, "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_content_before_a_call_is_streamed_before_it_is_decided():
    parser = ToolCallParser(PLAN)
    assert parser.feed("Sure, checking the weather ") == ("Sure, checking the weather ", [])
    assert parser.feed("<tool") == ("", [])  # could be a tag: held back
    content, calls = parser.feed('_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["get_time"]


def test_json_that_is_no_call_streams_as_soon_as_it_is_decided():
    parser = ToolCallParser(PLAN)
    assert parser.feed('{"name": "get_') == ("", [])  # could be get_weather or get_time
    parser = ToolCallParser(PLAN)
    assert parser.feed('{"name": "Ali') == ('{"name": "Ali', [])  # no tool is called "Ali..."
    parser = ToolCallParser(PLAN)
    assert parser.feed('{"age": 3, "name": "get_time"}') == ('{"age": 3, "name": "get_time"}', [])


def test_parallel_tool_calls_false_keeps_the_first():
    plan = plan_tools([WEATHER, TIME], "auto", False, "hermes")
    assert calls_of(TAGGED + TAGGED.replace("Paris", "Oslo"), plan)[1] == [("get_weather", {"city": "Paris"})]
    assert streamed(TAGGED + TAGGED.replace("Paris", "Oslo"), plan)[1] == [("get_weather", {"city": "Paris"})]


def test_plan_tools():
    assert PLAN.template_tools == [WEATHER, TIME] and PLAN.names == {"get_weather", "get_time"}
    none = plan_tools([WEATHER], "none", None, "hermes")
    assert none.template_tools is None and not none.names  # the model is not told about tools
    text_only = plan_tools([WEATHER], "auto", None, "none")
    assert text_only.template_tools == [WEATHER] and not text_only.names
    assert plan_tools(None, None, None, "hermes") == ToolPlan(None, frozenset())


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function"}], None, "tools[0]"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": 5}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": "get_weather"}, "tool_choice"),
    ([WEATHER], {"type": "function", "function": None}, "tool_choice"),
    ([WEATHER], {"type": "allowed_tools"}, "tool_choice"),
    (None, "auto", "tool_choice"),
])
def test_plan_tools_refuses(tools, choice, param):
    with pytest.raises(RequestError) as info:
        plan_tools(tools, choice, None, "hermes")
    assert info.value.param == param


def test_plan_tools_forced_choices():
    """tool_choice "required" or a named function: the calls the output is constrained to
    (server/structured.py); without a tool-call parser the call could not be read back: a 400."""
    assert plan_tools([WEATHER, TIME], "required", None, "hermes").forced == {"get_weather", "get_time"}
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False, "hermes")
    assert named.forced == {"get_time"} and named.names == {"get_weather", "get_time"} and not named.parallel
    assert not plan_tools([WEATHER], "auto", None, "hermes").forced
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(RequestError) as info:
            plan_tools([WEATHER], choice, None, "none")
        assert info.value.param == "tool_choice" and "tool-call parser" in str(info.value)


def test_history_tool_calls_parse_arguments_for_the_template():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": {"y": 2}}},
             {"id": "c", "type": "function", "function": {"name": "h", "arguments": ""}}]
    out = history_tool_calls(1, calls)
    assert [c["function"]["arguments"] for c in out] == [{"x": 1}, {"y": 2}, {}]
    assert out[0]["id"] == "a" and calls[0]["function"]["arguments"] == '{"x": 1}'  # the request is unchanged
    for bad, param in [("x", "messages[1].tool_calls"), ([5], "messages[1].tool_calls[0]"),
                       ([{"function": {"name": "f", "arguments": "{oops"}}],
                        "messages[1].tool_calls[0].function.arguments"),
                       ([{"function": {"name": "f", "arguments": "[" * 100000}}],  # RecursionError, not a 500
                        "messages[1].tool_calls[0].function.arguments")]:
        with pytest.raises(RequestError) as info:
            history_tool_calls(1, bad)
        assert info.value.param == param


def test_resolve_parser():
    assert resolve_parser("auto", "...<tool_call>...") == "hermes"
    assert resolve_parser("auto", "{{ messages }}") == "none"
    assert resolve_parser("auto", None) == "none"
    assert resolve_parser("hermes", None) == "hermes"
    assert resolve_parser("none", "<tool_call>") == "none"
