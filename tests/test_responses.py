"""/v1/responses against a FakeEngine, over real HTTP, with the official ``openai`` client: typed
stream events, previous_response_id chains over the bounded store, function calls, reasoning
items, and the 4xx errors of bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from fake_engine import SCRIPT, SCRIPT_TOKENS
from live_server import CALL, MSGS, TOOL_TEMPLATE, extra, make_server, wait_for

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
# every event a text-only stream sends, in order (the deltas repeat)
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def srv():  # conftest.py's engine fixture resets this server's engine after each test
    server = make_server(chat_template=TOOL_TEMPLATE, max_stored_responses=3)
    yield server
    server.close()


def squeeze(types: list[str]) -> list[str]:
    """Event types with runs of the same type collapsed."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def stream(client, **kw) -> list:
    return list(client.responses.create(model="fake-model", stream=True, **kw))


# ---------------------------------------------------------------- create

def test_create_renders_as_chat_and_reports_chat_usage(srv, engine):
    c = srv.client()
    r = c.responses.create(model="fake-model", input="Hi", instructions="Be brief.", temperature=0)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == SCRIPT and [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].status == "completed"
    prompt = engine.prompts[-1]
    chat = c.chat.completions.create(model="fake-model", temperature=0,
                                     messages=[{"role": "system", "content": "Be brief."}, *MSGS])
    assert engine.prompts[-1] == prompt == "system: Be brief.user: Hiassistant:"  # TOOL_TEMPLATE: no BOS, no newlines
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == SCRIPT_TOKENS
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert extra(r.usage, "speculative") == extra(chat.usage, "speculative")  # the same numbers, same code
    timings = extra(r, "timings")
    assert timings["predicted_n"] == SCRIPT_TOKENS and timings["draft_n"] == extra(chat.usage, "speculative")[
        "draft_tokens"]
    assert r.instructions == "Be brief." and r.temperature == 0 and r.store is True and r.tools == []


def test_stream_typed_events_and_sequence_numbers(srv, engine):
    events = stream(srv.client(), input="Hi")
    assert squeeze([e.type for e in events]) == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert text == done.text == final.output_text == SCRIPT
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    whole = srv.client().responses.create(model="fake-model", input="Hi")
    assert strip_ids([o.model_dump() for o in final.output]) == strip_ids([o.model_dump() for o in whole.output])
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_raw_sse_names_each_event(srv, engine):
    with srv.http.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert "[DONE]" not in blocks[-1]


def test_max_output_tokens_is_incomplete(srv, engine):
    c = srv.client()
    r = c.responses.create(model="fake-model", input="Hi", max_output_tokens=7)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == SCRIPT[:7] and r.output[0].status == "incomplete" and r.max_output_tokens == 7
    events = stream(c, input="Hi", max_output_tokens=7)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == SCRIPT[:7]
    assert next(e for e in events if e.type == "response.output_item.done").item.status == "incomplete"


def test_input_items_become_chat_messages(srv, engine):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Again"},
                                          {"type": "input_text", "text": "please"}]}]
    srv.client().responses.create(model="fake-model", input=items)
    assert engine.prompts[-1] == "system: Answer in French.user: Hiassistant: Salutuser: Again\npleaseassistant:"


# ---------------------------------------------------------------- previous_response_id and the store

def test_two_turn_chain(srv, engine):
    c = srv.client()
    engine.responder = lambda prompt, params: "Paris."
    first = c.responses.create(model="fake-model", input="Capital of France?", instructions="Be brief.")
    engine.responder = lambda prompt, params: "About 2 million."
    second = c.responses.create(model="fake-model", input="Its population?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == "About 2 million."
    # the history, without the first turn's instructions (OpenAI does not carry them over)
    assert engine.prompts[-1] == "user: Capital of France?assistant: Paris.user: Its population?assistant:"
    events = stream(c, input="And Lyon?", previous_response_id=second.id)
    assert "assistant: About 2 million.user: And Lyon?" in engine.prompts[-1]
    assert c.responses.retrieve(events[-1].response.id).output_text == "About 2 million."


def test_retrieve_delete_and_store_false(srv, engine):
    c = srv.client()
    r = c.responses.create(model="fake-model", input="Hi")
    assert c.responses.retrieve(r.id).output_text == SCRIPT
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    unstored = c.responses.create(model="fake-model", input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="fake-model", input="Hi", previous_response_id=unstored.id)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"


def test_input_items_of_a_stored_response(srv, engine):
    """GET /v1/responses/{id}/input_items, as OpenAI's (the openai client's input_items.list): the
    request's input items with ids, newest first by default, paged by after / limit; bad
    parameters are 400s, an unknown response a 404."""
    c = srv.client()
    assert [i.content[0].text for i in c.responses.input_items.list(
        c.responses.create(model="fake-model", input="Hi").id)] == ["Hi"]
    given = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": "Hello.", "id": "msg_mine"},
             {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]}]
    r = c.responses.create(model="fake-model", input=given)
    items = srv.http.get(f"/v1/responses/{r.id}/input_items", params={"order": "asc"}).json()
    assert items["object"] == "list" and not items["has_more"] and len(items["data"]) == 4
    assert [i["role"] for i in items["data"]] == ["system", "user", "assistant", "user"]
    assert items["data"][2] == {"type": "message", "role": "assistant", "id": "msg_mine", "status": "completed",
                                "content": [{"type": "output_text", "text": "Hello."}]}
    assert items["data"][0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert all(i["id"].startswith("msg_") and i["status"] == "completed" for i in items["data"])
    newest = srv.http.get(f"/v1/responses/{r.id}/input_items", params={"limit": 2}).json()
    assert [i["id"] for i in newest["data"]] == [i["id"] for i in items["data"][::-1][:2]] and newest["has_more"]
    rest = srv.http.get(f"/v1/responses/{r.id}/input_items", params={"limit": 2, "after": newest["last_id"]}).json()
    assert [i["role"] for i in rest["data"]] == ["user", "system"] and not rest["has_more"]
    assert [i.id for i in c.responses.input_items.list(r.id, order="asc")] == [i["id"] for i in items["data"]]
    for bad, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                       ({"after": "msg_none"}, "after")):
        got = srv.http.get(f"/v1/responses/{r.id}/input_items", params=bad)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, (bad, got.text)
    assert srv.http.get("/v1/responses/resp_none/input_items").status_code == 404


def test_a_server_that_stores_nothing_says_so():
    """--max-stored-responses 0: an answer says store false (it cannot be retrieved or chained)."""
    server = make_server(chat_template=TOOL_TEMPLATE, max_stored_responses=0)
    try:
        r = server.client().responses.create(model="fake-model", input="Hi")
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            server.client().responses.retrieve(r.id)
    finally:
        server.close()


def test_store_is_bounded_lru(srv, engine):
    c = srv.client()  # the store keeps 3
    a, b, d = (c.responses.create(model="fake-model", input=x) for x in "abd")
    c.responses.retrieve(a.id)  # a is now the most recently used
    e = c.responses.create(model="fake-model", input="e")  # pushes out b
    for kept in (a, d, e):
        assert c.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(b.id)


# ---------------------------------------------------------------- tools

def test_function_call_round_trip(srv, engine):
    c = srv.client()
    engine.responder = lambda prompt, params: "Checking.\n" + CALL
    r = c.responses.create(model="fake-model", input="Weather in Paris?", tools=[WEATHER])
    assert engine.prompts[-1].startswith('<tools>{"type": "function", "function": {"name": "get_weather"')
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Checking."
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed" and r.status == "completed"
    engine.responder = lambda prompt, params: "It is sunny."
    out = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    r2 = c.responses.create(model="fake-model", previous_response_id=r.id, input=[out], tools=[WEATHER])
    assert r2.output_text == "It is sunny."
    turn = ('assistant: Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            'tool: {"sky": "sunny"}assistant:')
    assert engine.prompts[-1].endswith(turn)
    # stateless: the client sends the output items back itself (as the SDK's docs do); the same prompt
    stateless = [{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in r.output],
                 out]
    c.responses.create(model="fake-model", input=stateless, tools=[WEATHER], store=False)
    assert engine.prompts[-1].endswith("user: Weather in Paris?" + turn)


def test_function_call_stream_events(srv, engine):
    engine.responder = lambda prompt, params: CALL + "\n" + CALL.replace("Paris", "Oslo")
    events = stream(srv.client(), input="Weather?", tools=[WEATHER])
    kinds = squeeze([e.type for e in events])
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds == ["response.created", "response.in_progress", *call_events, *call_events, "response.completed"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)["city"], e.output_index) for e in done] == [
        ("get_weather", "Paris", 0), ("get_weather", "Oslo", 1)]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert all(i.type == "function_call" and i.arguments == "" and i.status == "in_progress" for i in added)
    assert [o.call_id for o in events[-1].response.output] == [i.call_id for i in added]


def test_tools_need_a_template_that_renders_them():
    s = make_server()  # FAKE_TEMPLATE has no tools
    try:
        r = s.http.post("/v1/responses", json={"input": "Hi", "tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "tools_not_supported"
        r = s.http.post("/v1/responses", json={"input": "Hi", "tools": [WEATHER], "tool_choice": "none"})
        assert r.status_code == 200
    finally:
        s.close()


# ---------------------------------------------------------------- reasoning

def test_reasoning_item_and_tokens():
    s = make_server(reasoning_parser="qwen3")
    try:
        s.engine.responder = lambda prompt, params: "<think>\nTwo plus two.\n</think>\n\nFour."
        c = s.client()
        r = c.responses.create(model="fake-model", input="2+2?")
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "Two plus two." and r.output_text == "Four."
        assert r.usage.output_tokens_details.reasoning_tokens == len("Two plus two.")
        events = stream(c, input="2+2?")
        assert squeeze([e.type for e in events])[2:9] == [
            "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
            "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
            "response.output_item.added"]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Two plus two."
        assert strip_ids([o.model_dump() for o in events[-1].response.output]) == strip_ids(
            [o.model_dump() for o in r.output])
        s.engine.responder = lambda prompt, params: "Fine."
        c.responses.create(model="fake-model", input="ok?", previous_response_id=r.id)
        assert "<|assistant|>Four.\n<|user|>ok?" in s.engine.prompts[-1]
    finally:
        s.close()


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("body,param,code", [
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id", "previous_response_not_found"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type", None),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", None),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input", "images_not_supported"),  # a text-only model
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]},
     "input[0].content[0].type", None),
    ({"input": [{"role": "user", "content": None}]}, "input[0].content", None),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id", None),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input[0].arguments", None),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", None),
    ({"input": 5}, "input", None),
    ({}, "input", None),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", None),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", None),
    ({"input": "x", "tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice", None),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", None),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                        "strict": "yes"}}}, "text.format.strict", None),
    ({"input": "x", "background": True}, "background", None),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens", "context_length_exceeded"),
    ({"input": "x", "temperature": "hot"}, "temperature", None),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", None),
])
def test_bad_input_is_a_400(srv, engine, body, param, code):
    r = srv.http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if code:
        assert err["code"] == code
    assert srv.http.post("/v1/responses", json={"input": "still serving", "max_output_tokens": 2}).status_code == 200


def test_openai_client_errors(srv, engine):
    c = srv.client()
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.create(model="gpt-5", input="Hi")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model="fake-model", input=[{"type": "bogus"}])
    r = srv.http.post("/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_disconnect_mid_stream_aborts(srv, engine):
    engine.step_delay = 0.02
    engine.responder = lambda prompt, params: "word " * 80
    before = len(engine.aborted)
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        with http.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 12:
                    break
    assert wait_for(lambda: len(engine.aborted) > before)
