"""The HTTP server's reasoning split (reasoning_content vs content, streamed and not) and tool calls
(parsed from the output, round-tripped through the history, streamed)."""

from __future__ import annotations

import json
import random

import pytest

from live_server import CALL, MSGS, TOOL_TEMPLATE, TOOLS, extra, make_server
from specserve.server.reasoning import ReasoningParser, split_all


# ---------------------------------------------------------------- reasoning

THINK_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:\n<think>\n"


def _stream_split(client, **kw):
    reasoning, content, order, finish = "", "", [], None
    for ch in client.chat.completions.create(model="fake-model", messages=MSGS, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        r = extra(d, "reasoning_content")
        if r:
            assert extra(d, "reasoning") == r
            reasoning += r
            order.append("r")
        if d.content:
            content += d.content
            order.append("c")
        finish = ch.choices[0].finish_reason or finish
    assert order == sorted(order, key=lambda x: x != "r"), "reasoning must come before content"
    return (reasoning or None), content, finish


def _both_ways(server, output, **kw):
    """(reasoning, content, finish) non-streaming, and the same streamed (must agree)."""
    server.engine.responder = lambda prompt, params: output
    c = server.client()
    r = c.chat.completions.create(model="fake-model", messages=MSGS, **kw)
    msg = r.choices[0].message
    got = (extra(msg, "reasoning_content"), msg.content, r.choices[0].finish_reason)
    assert extra(msg, "reasoning") == got[0]
    streamed = _stream_split(c, **kw)
    assert streamed == (got[0], got[1] or "", got[2])
    return got


@pytest.fixture(scope="module")
def qwen_srv():
    s = make_server(reasoning_parser="qwen3")
    yield s
    s.close()


def test_reasoning_qwen3_tags_in_output(qwen_srv):
    got = _both_ways(qwen_srv, "<think>\nLet me think.\n</think>\n\nThe answer is 4.")
    assert got == ("Let me think.", "The answer is 4.", "stop")


def test_reasoning_prompt_opened_think(qwen_srv):
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    got = _both_ways(qwen_srv, "Hmm, two plus two.</think>Four.", **kw)
    assert qwen_srv.engine.prompts[-1].endswith("<think>\n")
    assert got == ("Hmm, two plus two.", "Four.", "stop")


def test_reasoning_never_closed(qwen_srv):
    kw = {"max_tokens": 12, "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    got = _both_ways(qwen_srv, "I keep thinking and thinking", **kw)
    assert got == ("I keep think", None, "length")


def test_reasoning_qwen3_no_tags_is_content(qwen_srv):
    assert _both_ways(qwen_srv, "Just an answer.") == (None, "Just an answer.", "stop")


def test_reasoning_custom_template_opens_think():
    s = make_server(reasoning_parser="qwen3", chat_template=THINK_TEMPLATE)
    try:
        got = _both_ways(s, "Working it out.</think>\nDone.")
        assert s.engine.prompts[-1] == "user: Hi\nassistant:\n<think>"  # jinja drops the last newline
        assert got == ("Working it out.", "Done.", "stop")
    finally:
        s.close()


def test_reasoning_deepseek_r1():
    s = make_server(reasoning_parser="deepseek_r1")
    try:
        assert _both_ways(s, "Reasoning here.</think>Answer.") == ("Reasoning here.", "Answer.", "stop")
        assert _both_ways(s, "<think>R</think>A") == ("R", "A", "stop")
        assert _both_ways(s, "No tags at all") == ("No tags at all", None, "stop")
    finally:
        s.close()


def test_no_reasoning_parser_leaves_tags_in_content(srv, engine):
    engine.responder = lambda prompt, params: "<think>x</think>y"
    msg = srv.client().chat.completions.create(model="fake-model", messages=MSGS).choices[0].message
    assert msg.content == "<think>x</think>y" and extra(msg, "reasoning_content") is None


@pytest.mark.parametrize("kind,opened,text", [
    ("qwen3", False, "<think>\nI reason.\n</think>\n\nThe answer."),
    ("qwen3", True, "I reason. </thi nk> more</think>Ans"),
    ("qwen3", False, "plain <think> x"),
    ("qwen3", True, "never closed </thi"),
    ("qwen3", False, "  <thi"),
    ("deepseek_r1", False, "<think>R</think>A"),
    ("deepseek_r1", False, "no tags"),
])
def test_reasoning_parser_any_chunking(kind, opened, text):
    whole = split_all(kind, opened, text)
    for seed in range(100):
        rnd, parser, r_all, c_all, i = random.Random(seed), ReasoningParser(kind, opened), "", "", 0
        while i < len(text):
            k = rnd.randint(1, 5)
            r, c = parser.feed(text[i:i + k])
            assert not (c_all and r), "reasoning after content"
            r_all, c_all, i = r_all + r, c_all + c, i + k
        r, c = parser.finish()
        assert ((r_all + r) or None, c_all + c) == whole


# ---------------------------------------------------------------- tool calls


@pytest.fixture(scope="module")
def tool_srv():
    s = make_server(chat_template=TOOL_TEMPLATE)  # auto: the template writes <tool_call>, so hermes
    yield s
    s.close()


def _stream_tools(client, **kw) -> tuple[str, dict, str | None]:
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(model="fake-model", messages=MSGS, stream=True, **kw):
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, calls, finish


def test_tool_calls_parsed_from_output(tool_srv):
    tool_srv.engine.responder = lambda prompt, params: "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    c = tool_srv.client()
    r = c.chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS)
    assert tool_srv.engine.prompts[-1].startswith('<tools>{"type": "function", "function": {"name": "get_weather"')
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and msg.content == "Checking.\n"  # as the stream joins it
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Oslo"})]
    content, calls, finish = _stream_tools(c, tools=TOOLS)
    assert finish == "tool_calls" and content == msg.content
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert all(v["id"].startswith("call_") for v in calls.values())


def test_tool_call_history_round_trip(tool_srv):
    """An assistant turn with content null and tool_calls (arguments as a JSON string), then the tool's
    answer: the template sees the arguments as an object (it was a 400 for content null)."""
    tool_srv.engine.responder = lambda prompt, params: "It is sunny in Paris."
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    r = tool_srv.http.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert ('assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            'tool: {"sky": "sunny"}') in tool_srv.engine.prompts[-1]


def test_tokenize_messages_with_tools_counts_what_chat_renders(tool_srv):
    with_tools = tool_srv.http.post("/tokenize", json={"messages": MSGS, "tools": TOOLS}).json()
    without = tool_srv.http.post("/tokenize", json={"messages": MSGS}).json()
    assert with_tools["count"] > without["count"]
    tool_srv.engine.responder = lambda prompt, params: "ok"
    tool_srv.client().chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS)
    assert tool_srv.engine.tokenizer.decode(with_tools["tokens"], False).endswith(tool_srv.engine.prompts[-1])
    assert tool_srv.engine.prompts[-1].startswith("<tools>")


def test_tool_choice_none_and_no_parser(tool_srv, srv, engine):
    tool_srv.engine.responder = lambda prompt, params: CALL
    r = tool_srv.client().chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS,
                                                  tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None
    assert not tool_srv.engine.prompts[-1].startswith("<tools>")  # not offered to the model
    engine.responder = lambda prompt, params: CALL  # FAKE_TEMPLATE does not render tools: a 400 that says so
    for path, body in (("/v1/chat/completions", {"messages": MSGS}), ("/tokenize", {"messages": MSGS})):
        r = srv.http.post(path, json={**body, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["code"] == "tools_not_supported", r.text
        assert r.json()["error"]["param"] == "tools" and "--chat-template" in r.json()["error"]["message"]
    r = srv.client().chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"
    s = make_server(chat_template=TOOL_TEMPLATE, tool_call_parser="none")  # offered, but calls stay text
    try:
        s.engine.responder = lambda prompt, params: CALL
        r = s.client().chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS)
        assert r.choices[0].message.content == CALL and s.engine.prompts[-1].startswith("<tools>")
    finally:
        s.close()


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_tool_request_errors(tool_srv, body, param):
    r = tool_srv.http.post("/v1/chat/completions", json={"messages": MSGS, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_reasoning_parser_names_missing_think_tokens():
    """vLLM's parsers refuse a tokenizer without <think>/</think> tokens; ours split by text (a
    model may spell the tags out), so serve warns instead: the tags it lacks, none where it has them."""
    import copy

    from specserve.models.loader import load_tokenizer
    from specserve.server.reasoning import missing_think_tokens

    tok = load_tokenizer("smollm2-135m")
    assert missing_think_tokens("none", tok) == []
    for kind in ("qwen3", "deepseek_r1"):
        assert missing_think_tokens(kind, tok) == ["<think>", "</think>"]
    thinking = copy.copy(tok)
    thinking.backend = tok.backend.__class__.from_str(tok.backend.to_str())
    thinking.backend.add_special_tokens(["<think>", "</think>"])
    assert missing_think_tokens("qwen3", thinking) == []
