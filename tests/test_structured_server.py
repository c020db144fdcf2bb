"""Structured outputs through the HTTP server (``specserve serve`` subprocesses, the openai client):
response_format, structured_outputs and the guided_* fields, streamed and not, with n-gram
speculation; tool_choice "required" and a named function on qwen2.5-coder-0.5b; schemas the
server refuses (unsupported keywords, hostile size or depth, a compile past the time limit)
get a 400 and the server keeps serving; with --reasoning-parser the grammar starts after
</think>.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from specserve.bench.structured_cases import REGEXES, SCHEMAS
from test_server_live import SPEC, Subprocess

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CASES = SCHEMAS[::6]  # 9 schemas of different shapes
COMPILE_TIMEOUT = 0.3  # seconds; the slow schema below takes several


@pytest.fixture(scope="module")
def server():
    srv = Subprocess("--speculative-config", SPEC, "--max-model-len", "2048",
                     "--grammar-compile-timeout", str(COMPILE_TIMEOUT))
    yield srv
    srv.close()


def chat(client, prompt: str, stream: bool = False, **kw):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=96, **kw)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    return text, finish


def validate(schema, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def error_of(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body if isinstance(info.value.body, dict) and "message" in info.value.body \
        else info.value.body["error"]


@pytest.mark.parametrize("name,prompt,schema", CASES, ids=[c[0] for c in CASES])
def test_json_schema_streamed_and_not(server, name, prompt, schema):
    c = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    text, finish = chat(c, prompt + " Answer in JSON.", response_format=fmt)
    assert finish == "stop"
    validate(schema, text)
    assert chat(c, prompt + " Answer in JSON.", stream=True, response_format=fmt) == (text, finish)


def test_every_way_of_asking_for_a_constraint(server):
    c = server.client()
    schema = SCHEMAS[0][2]
    name, prompt, regex = REGEXES[0]
    asks = [
        (dict(response_format={"type": "json_object"}), lambda t: isinstance(json.loads(t), dict)),
        (dict(extra_body={"structured_outputs": {"json": schema}}), lambda t: validate(schema, t) is None),
        (dict(extra_body={"structured_outputs": {"json_object": True}}), lambda t: isinstance(json.loads(t), dict)),
        (dict(extra_body={"structured_outputs": {"regex": regex}}), lambda t: re.fullmatch(regex, t)),
        (dict(extra_body={"structured_outputs": {"choice": ["yes", "no", "a (b) c"]}}),
         lambda t: t in ("yes", "no", "a (b) c")),
        (dict(extra_body={"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}),
         lambda t: re.fullmatch("x[0-9]{2}", t)),
        (dict(extra_body={"structured_outputs": {"grammar": 'start: "y" /[a-c]{1,5}/ "."'}}),
         lambda t: re.fullmatch("y[a-c]{1,5}\\.", t)),
        (dict(extra_body={"guided_json": json.dumps(schema), "guided_decoding_backend": "xgrammar"}),
         lambda t: validate(schema, t) is None),
        (dict(extra_body={"guided_regex": regex}), lambda t: re.fullmatch(regex, t)),
        (dict(extra_body={"guided_choice": ["red", "green"]}), lambda t: t in ("red", "green")),
        (dict(extra_body={"guided_grammar": 'root ::= "ab" | "cd"'}), lambda t: t in ("ab", "cd")),
        (dict(extra_body={"guided_json": schema, "guided_whitespace_pattern": "[ \\n]{0,2}"}),
         lambda t: validate(schema, t) is None),
        (dict(extra_body={"grammar": 'root ::= "z" [0-9]'}), lambda t: re.fullmatch("z[0-9]", t)),  # llama-server's
        (dict(extra_body={"json_schema": schema}), lambda t: validate(schema, t) is None),
    ]
    for kw, ok in asks:
        # the JSON asks get the schema's prompt: asked for a phone number as any JSON object,
        # smollm2 writes one endless key (a valid prefix until max_tokens), which tests nothing
        ask = (SCHEMAS[0][1] if "json" in json.dumps(kw) else prompt) + " Answer in JSON."
        text, finish = chat(c, ask, **kw)
        assert finish == "stop" and ok(text), (kw, text)
        assert chat(c, ask, stream=True, **kw)[0] == text, kw
    r = c.completions.create(model=MODEL, prompt="My phone number is ", max_tokens=20, temperature=0,
                             extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, r.choices[0].text), r.choices[0].text
    # llama-server's own /completion with its grammar (GBNF) and json_schema fields
    r = server.http.post("/completion", json={"prompt": "Pick one:", "grammar": 'root ::= "ab" | "cd"',
                                              "temperature": 0, "n_predict": 8}).json()
    assert r["content"] in ("ab", "cd") and r["stop_type"] == "eos", r
    r = server.http.post("/completion", json={"prompt": SCHEMAS[0][1], "json_schema": schema, "temperature": 0,
                                              "n_predict": 200}).json()
    validate(schema, r["content"])


def test_refused_schemas_get_a_400_and_the_server_keeps_serving(server):
    c = server.client()

    def ask(**kw):
        return lambda: chat(c, "Give a person.", **kw)

    err = error_of(ask(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}},
                                "not": {"required": ["x"]}}}}))
    assert "unsupported JSON Schema keywords" in err["message"] and "uniqueItems" in err["message"] \
        and "not" in err["message"] and err["param"] == "response_format.json_schema.schema"
    deep = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    err = error_of(ask(extra_body={"structured_outputs": {"json": deep}}))
    assert err["param"] == "structured_outputs.json"
    slow = {"type": "object", "properties": {
        f"p{i}": {"anyOf": [{"type": "integer", "minimum": i, "maximum": 7 * i + 3},
                            {"type": "string", "maxLength": i % 30 + 1}]} for i in range(5000)}}
    err = error_of(ask(extra_body={"guided_json": slow}))
    assert "took longer than" in err["message"] and err["param"] == "guided_json", err
    for kw, param in [
        (dict(extra_body={"guided_regex": "[a-z"}), "guided_regex"),
        (dict(extra_body={"guided_choice": []}), "guided_choice"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
        (dict(extra_body={"structured_outputs": {"structural_tag": "{}"}}), "structured_outputs"),
        (dict(extra_body={"guided_grammar": "root ::= \"a"}), "guided_grammar"),  # an unclosed string
        (dict(extra_body={"grammar": "root ::= \"a"}), "grammar"),
        (dict(extra_body={"json_schema": {"type": "object"}, "guided_regex": "a"}), "json_schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),
        (dict(response_format={"type": "xml"}), "response_format.type"),
    ]:
        assert error_of(ask(**kw))["param"] == param, kw
    text, finish = chat(c, "Give a person's name and age. Answer in JSON.",
                        extra_body={"structured_outputs": {"json": SCHEMAS[0][2]}})
    validate(SCHEMAS[0][2], text)
    assert server.http.get("/health").status_code == 200


def test_tools_need_a_tool_call_parser(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    err = error_of(lambda: chat(server.client(), "hi", tools=[tool], tool_choice="required"))
    assert err["param"] in ("tool_choice", "tools") and "tool" in err["message"]


# ---------------------------------------------------------------- forced tool calls (qwen)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 40}, "max_results": {"type": "integer", "minimum": 1,
                                                                         "maximum": 10}},
            "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time", "parameters": None}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] or {"type": "object"} for t in TOOLS}
TOOL_PROMPTS = ["What's the weather in Paris right now?", "Find me the latest news about Mars.",
                "What time is it?", "Tell me a joke."]


@pytest.fixture(scope="module")
def qwen():
    srv = Subprocess("--speculative-config", SPEC, "--max-model-len", "2048", model="qwen2.5-coder-0.5b")
    yield srv
    srv.close()


def calls_of(client, prompt: str, choice, stream: bool, parallel: bool | None = None):
    kw = dict(model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": prompt}], tools=TOOLS,
              tool_choice=choice, temperature=0, max_tokens=120)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    if not stream:
        r = client.chat.completions.create(**kw).choices[0]
        return [(t.function.name, t.function.arguments) for t in r.message.tool_calls or []], r.finish_reason
    calls, finish = {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        for tc in ch.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [tuple(v) for _, v in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", ["required", "get_weather", "search", "get_time"])
def test_forced_tool_choice_gives_valid_calls(qwen, choice):
    c = qwen.client()
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    runs = [(p, None) for p in TOOL_PROMPTS] + ([(TOOL_PROMPTS[1], False)] if choice == "required" else [])
    for i, (prompt, parallel) in enumerate(runs):
        calls, finish = calls_of(c, prompt, tool_choice, False, parallel)
        assert finish == "tool_calls" and calls, (prompt, calls)
        assert parallel is None or len(calls) == 1
        for name, args in calls:
            assert choice == "required" or name == choice
            jsonschema.validate(json.loads(args), PARAMS[name])
        if i == 0 or parallel is False:
            assert calls_of(c, prompt, tool_choice, True, parallel) == (calls, finish)


# ---------------------------------------------------------------- reasoning

def test_with_a_reasoning_parser_the_grammar_starts_after_think():
    """deepseek_r1: the output is reasoning until </think>; the schema holds for the content after.
    The assistant turn is continued after two worked examples, so the small model closes its
    thought as they do."""
    srv = Subprocess("--reasoning-parser", "deepseek_r1", "--max-model-len", "2048")
    try:
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["n"], "additionalProperties": False}
        lead = ("<think>\nThe user wants a number.\n</think>\n{\"n\": 1}\n<think>\nAnother number.\n</think>\n"
                "{\"n\": 2}\n<think>\nOne more.\n")
        kw = dict(model=MODEL, temperature=0, max_tokens=40,
                  messages=[{"role": "user", "content": "Give numbers."}, {"role": "assistant", "content": lead}],
                  extra_body={"continue_final_message": True, "add_generation_prompt": False,
                              "structured_outputs": {"json": schema}})
        msg = srv.client().chat.completions.create(**kw).choices[0].message
        validate(schema, msg.content)  # the content alone: </think> went to the reasoning
    finally:
        srv.close()
