"""/v1/responses, tools refused by a template without them, timings and system_fingerprint with real
models: ``specserve serve`` as a subprocess, driven by the official ``openai`` client (slow)."""

from __future__ import annotations

import json

import pytest

from test_server_live import SPEC, Subprocess

pytestmark = pytest.mark.slow

QWEN = "qwen2.5-coder-0.5b"  # its template renders tools
SMOL = "smollm2-135m"  # its template does not
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = "What's the weather in Paris right now?"


@pytest.fixture(scope="module")
def qwen():
    server = Subprocess("--speculative-config", SPEC, "--max-model-len", "2048", model=QWEN)
    yield server
    server.close()


def test_responses_stream_and_not_equal_chat(qwen):
    c = qwen.client()
    prompt = "Write a Python function that returns the squares of a list of numbers."
    r = c.responses.create(model=QWEN, input=prompt, temperature=0, max_output_tokens=48)
    assert r.status in ("completed", "incomplete") and r.output_text
    spec = r.usage.model_extra["speculative"]
    assert spec["steps"] > 0 and spec["draft_tokens"] >= spec["accepted_tokens"]
    chat = c.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": prompt}], temperature=0,
                                     max_tokens=48)
    assert r.output_text == chat.choices[0].message.content  # the same prompt, the same greedy output
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    events = list(c.responses.create(model=QWEN, input=prompt, temperature=0, max_output_tokens=48, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_two_turn_chain(qwen):
    c = qwen.client()
    first = c.responses.create(model=QWEN, input="My name is Ada. Reply with one word: OK.", temperature=0,
                               max_output_tokens=8)
    second = c.responses.create(model=QWEN, input="What is my name?", previous_response_id=first.id,
                                temperature=0, max_output_tokens=16)
    # the second prompt holds the first turn and its answer
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id and c.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(Exception) as info:
        c.responses.create(model=QWEN, input="x", previous_response_id="resp_0000")
    assert getattr(info.value, "status_code", None) == 400


def test_function_call_round_trip(qwen):
    c = qwen.client()
    r = c.responses.create(model=QWEN, input=ASK, tools=[WEATHER], temperature=0, max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(o.name, json.loads(o.arguments)["city"]) for o in calls] == [("get_weather", "Paris")], r.output
    events = list(c.responses.create(model=QWEN, input=ASK, tools=[WEATHER], temperature=0, max_output_tokens=80,
                                     stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [(o.name, json.loads(o.arguments)) for o in calls]
    out = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp_c": 14, "sky": "clear"}'}
    answer = c.responses.create(model=QWEN, previous_response_id=r.id, input=[out], tools=[WEATHER],
                                temperature=0, max_output_tokens=60)
    assert answer.status in ("completed", "incomplete") and (answer.output_text or any(
        o.type == "function_call" for o in answer.output))
    assert answer.usage.input_tokens > r.usage.input_tokens


def test_text_format_json_schema_and_a_forced_function(qwen):
    """text.format json_schema constrains the output (streamed and not, with speculation); a
    named tool_choice forces a call whose arguments match the tool's schema; both at once: 400."""
    import jsonschema

    c = qwen.client()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    kw = dict(model=QWEN, input="Give a person's name and age.", temperature=0, max_output_tokens=60, text=fmt)
    r = c.responses.create(**kw)
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    events = list(c.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    forced = dict(model=QWEN, input="Tell me a joke.", tools=[WEATHER], temperature=0, max_output_tokens=80,
                  tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in c.responses.create(**forced).output if o.type == "function_call"]
    assert calls and all(o.name == "get_weather" for o in calls)
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    with pytest.raises(Exception) as info:
        c.responses.create(**forced, text=fmt)
    assert getattr(info.value, "status_code", None) == 400


@pytest.fixture(scope="module")
def smol():
    server = Subprocess("--max-model-len", "2048", model=SMOL)
    yield server
    server.close()


def test_tools_without_template_support_are_a_400(smol):
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    r = smol.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ASK}],
                                                     "tools": [chat_tool]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "tools_not_supported", r.text
    r = smol.http.post("/v1/responses", json={"input": ASK, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = smol.client().responses.create(model=SMOL, input="Say hi.", max_output_tokens=4)  # still serving
    assert r.output_text


def test_timings_count_processed_and_cached_tokens(smol):
    c = smol.client()
    msgs = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea. " * 6}]
    first = c.chat.completions.create(model=SMOL, messages=msgs, max_tokens=4, temperature=0)
    again = c.chat.completions.create(model=SMOL, messages=msgs, max_tokens=4, temperature=0)
    for r in (first, again):
        t = r.model_extra["timings"]
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert t["cache_n"] == cached and t["prompt_n"] == r.usage.prompt_tokens - cached
        assert t["predicted_n"] == r.usage.completion_tokens
        assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"], abs=2e-3)
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / t["predicted_n"], abs=2e-3)
        assert "draft_n" not in t  # no speculation on this server
    assert again.model_extra["timings"]["cache_n"] > 0  # the prefix cache served the repeat


def test_fingerprint_and_models_retrieve(smol, qwen):
    fp = smol.client().chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2).system_fingerprint
    other = qwen.client().completions.create(model=QWEN, prompt="def", max_tokens=2).system_fingerprint
    assert fp.startswith("fp_") and other.startswith("fp_") and fp != other
    assert smol.client().models.retrieve(SMOL).id == SMOL


def test_fingerprint_of_real_engines():
    """Stable for the same flags; different when the KV dtype or the speculative config changes."""
    from engine_utils import make_engine
    from specserve.engine.async_engine import AsyncEngine
    from specserve.server.fingerprint import describe, system_fingerprint

    def fp(*flags: str) -> str:
        return system_fingerprint(describe(AsyncEngine(make_engine("--model", SMOL, "--max-model-len", "512",
                                                                   *flags), SMOL)))

    base = fp()
    assert fp() == base
    assert len({base, fp("--kv-cache-dtype", "int8"), fp("--speculative-config", SPEC)}) == 3
