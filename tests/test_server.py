"""The HTTP server against a FakeEngine, over real HTTP (uvicorn in a thread).

The official ``openai`` client checks wire compatibility; ``httpx`` checks
error statuses and bodies, limits and disconnects.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import socket
import sys
import tempfile
import threading
import time
import types

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import SCRIPT, SCRIPT_TOKENS, FakeEngine
from specserve.errors import RequestError, SpecserveError
from specserve.server.app import create_app
from specserve.server.config import ServerConfig
from specserve.server.reasoning import ReasoningParser, split_all


class LiveServer:
    """create_app(engine, cfg) served by uvicorn on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, engine: FakeEngine, cfg: ServerConfig):
        self.engine = engine
        self.app = create_app(engine, cfg)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert self.thread.is_alive(), "uvicorn exited during startup"
            time.sleep(0.01)
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=10)

    def metrics(self) -> dict[tuple, float]:
        text = self.http.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=5)


def make_server(engine: FakeEngine | None = None, **cfg) -> LiveServer:
    return LiveServer(engine or FakeEngine(), ServerConfig(**cfg))


@pytest.fixture(scope="module")
def srv():
    server = make_server()
    yield server
    server.close()


@pytest.fixture
def engine(srv):
    """The shared server's engine, reset to its defaults after each test."""
    yield srv.engine
    srv.engine.responder = lambda prompt, params: SCRIPT
    srv.engine.step_delay = 0.0
    srv.engine.fail_next = None


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


MSGS = [{"role": "user", "content": "Hi"}]


# ---------------------------------------------------------------- basics

def test_models_health_version(srv):
    models = srv.client().models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert srv.http.get("/health").status_code == 200
    assert srv.http.get("/version").json()["version"]


def test_chat_non_streaming(srv, engine):
    resp = srv.client().chat.completions.create(model="fake-model", messages=MSGS, temperature=0)
    choice = resp.choices[0]
    assert choice.message.content == SCRIPT and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert engine.prompts[-1] == "<s><|user|>Hi\n<|assistant|>"  # template's BOS, no second one
    assert resp.usage.prompt_tokens == len("<|user|>Hi\n<|assistant|>") + 1
    assert resp.usage.completion_tokens == SCRIPT_TOKENS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    spec = extra(resp.usage, "speculative")
    assert spec["steps"] > 0 and spec["draft_tokens"] == 4 * spec["steps"]
    assert spec["mean_acceptance_length"] == pytest.approx((spec["accepted_tokens"] + spec["steps"]) / spec["steps"],
                                                          abs=1e-5)
    timings = extra(resp, "timings")
    assert timings["draft_n"] == spec["draft_tokens"] and timings["draft_n_accepted"] == spec["accepted_tokens"]
    assert timings["predicted_n"] == SCRIPT_TOKENS and timings["predicted_per_second"] > 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(srv, engine):
    """The scripted engine is the real engine: a second identical prompt reuses the first's
    cached blocks (usage reports them) and gets the same answer."""
    msgs = [{"role": "user", "content": "a prompt of several blocks " * 4}]
    first, second = (srv.client().chat.completions.create(model="fake-model", messages=msgs, temperature=0)
                     for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    assert second.choices[0].message.content == first.choices[0].message.content == SCRIPT


def test_chat_length_and_max_completion_tokens(srv, engine):
    c = srv.client()
    r = c.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=5)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (SCRIPT[:5], "length")
    r = c.chat.completions.create(model="fake-model", messages=MSGS, max_completion_tokens=7, max_tokens=5)
    assert r.choices[0].message.content == SCRIPT[:7] and r.usage.completion_tokens == 7


def test_sampling_params_reach_engine(srv, engine):
    srv.client().chat.completions.create(
        model="fake-model", messages=MSGS, temperature=0.7, top_p=0.9, seed=11, stop="zzz",
        presence_penalty=0.5, frequency_penalty=0.25, user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "max_tokens": 9,
                    "min_tokens": 2, "include_stop_str_in_output": True, "skip_special_tokens": False,
                    "some_future_field": {"x": 1}},
        response_format={"type": "text"})
    _, p = engine.requests[-1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 20, 0.05, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert p.stop == ("zzz",) and p.ignore_eos and p.max_tokens == 9 and p.logit_bias == ()
    assert p.min_tokens == 2 and p.include_stop_str_in_output and not p.skip_special_tokens


def test_continue_final_message_leaves_the_assistant_turn_open(srv, engine):
    """vLLM's continue_final_message: the prompt ends where the last (assistant) message's text ends,
    so the model continues it; /tokenize counts the same prompt."""
    msgs = [*MSGS, {"role": "assistant", "content": "Sure, here "}]
    r = srv.http.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True,
                                                    "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert engine.prompts[-1] == "<s><|user|>Hi\n<|assistant|>Sure, here "  # no end of turn, no new turn
    tok = srv.http.post("/tokenize", json={"messages": msgs, "continue_final_message": True}).json()
    assert tok["count"] == r.json()["usage"]["prompt_tokens"]
    r = srv.http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
    assert engine.prompts[-1].endswith("Sure, here \n<|assistant|>")  # without it: a new turn
    for body, param in (({"messages": MSGS, "continue_final_message": True}, "messages"),
                        ({"messages": msgs, "continue_final_message": True, "add_generation_prompt": True},
                         "continue_final_message")):
        r = srv.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    s = make_server(chat_template="{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    try:  # a template that rewrites the text cannot be continued: said, not guessed
        r = s.http.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True})
        assert r.status_code == 400 and "does not write the last message's text" in r.json()["error"]["message"]
    finally:
        s.close()


def test_vllm_fields_at_their_defaults_are_accepted_and_unknown_ones_logged(srv, engine, caplog):
    """A request that names vLLM's fields with their default values (as some clients always do)
    is served; a field the server does not know is ignored and logged by name."""
    import logging

    body = {"messages": MSGS, "max_tokens": 3, "best_of": 1, "use_beam_search": False, "min_tokens": 0,
            "skip_special_tokens": True, "guided_json": None, "echo": False, "prompt_logprobs": None,
            "bad_words": [], "length_penalty": 1.0, "some_future_field": 1}
    with caplog.at_level(logging.INFO, logger="specserve.server"):
        r = srv.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert "request fields ignored: some_future_field" in caplog.text


def test_logit_bias_reaches_engine(srv, engine):
    srv.client().completions.create(model="fake-model", prompt="hi", max_tokens=2,
                                    logit_bias={"70": 5, "12": -100})
    assert engine.requests[-1][1].logit_bias == ((12, -100.0), (70, 5.0))


def test_completions_prompt_forms(srv, engine):
    c = srv.client()
    r = c.completions.create(model="fake-model", prompt="Once", max_tokens=4)
    assert r.choices[0].text == SCRIPT[:4] and r.choices[0].finish_reason == "length"
    assert engine.prompts[-1] == "<s>Once"  # BOS added for raw text
    assert r.usage.prompt_tokens == 5
    r = c.completions.create(model="fake-model", prompt=["A", "BC"], max_tokens=3)
    assert sorted(ch.index for ch in r.choices) == [0, 1] and r.usage.prompt_tokens == 2 + 3
    ids = [ord(ch) + 3 for ch in "xyz"]
    r = c.completions.create(model="fake-model", prompt=ids, max_tokens=3)
    assert engine.prompts[-1] == "xyz" and r.usage.prompt_tokens == 3  # token ids as given
    r = c.completions.create(model="fake-model", prompt=[ids, ids[:1]], max_tokens=2, n=2)
    assert len(r.choices) == 4 and r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8
    r = c.completions.create(model="fake-model", prompt="Echo me", max_tokens=3, echo=True)
    assert r.choices[0].text == "Echo me" + SCRIPT[:3]


def test_completions_default_max_tokens_is_16(srv, engine):
    r = srv.client().completions.create(model="fake-model", prompt="x")
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- streaming

def test_chat_stream_include_usage(srv, engine):
    stream = srv.client().chat.completions.create(model="fake-model", messages=MSGS, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == SCRIPT
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["stop"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == SCRIPT_TOKENS
    assert extra(last.usage, "speculative")["steps"] > 0 and extra(last, "timings")["predicted_n"] == SCRIPT_TOKENS
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len({ch.id for ch in chunks}) == 1


def test_stream_raw_sse_ends_with_done(srv, engine):
    body = {"model": "fake-model", "messages": MSGS, "stream": True, "max_tokens": 6}
    with srv.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "timings" in events[-1] and events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events)  # no include_usage: no usage fields at all


def test_completions_stream(srv, engine):
    stream = srv.client().completions.create(model="fake-model", prompt="p", max_tokens=20, stream=True,
                                             n=2, stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.text
        if ch.usage:
            assert ch.usage.completion_tokens == 40
    assert texts == {0: SCRIPT[:20], 1: SCRIPT[:20]}


def test_stop_strings(srv, engine):
    c = srv.client()
    r = c.chat.completions.create(model="fake-model", messages=MSGS, stop=["scripted", "zz"])
    assert r.choices[0].message.content == "Hello there! This is a " and r.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model="fake-model", messages=MSGS, stop="This", stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == "Hello there! "


# ---------------------------------------------------------------- logprobs and n

def test_chat_logprobs(srv, engine):
    r = srv.client().chat.completions.create(model="fake-model", messages=MSGS, logprobs=True, top_logprobs=2,
                                             max_tokens=6)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == SCRIPT[:6]
    first = content[0]
    assert first.bytes == list(SCRIPT[0].encode()) and first.logprob <= 0
    assert len(first.top_logprobs) == 2 and first.top_logprobs[0].token == SCRIPT[0]
    stream = srv.client().chat.completions.create(model="fake-model", messages=MSGS, logprobs=True,
                                                  max_tokens=6, stream=True)
    tokens = [t.token for ch in stream if ch.choices and ch.choices[0].logprobs
              for t in ch.choices[0].logprobs.content]
    assert "".join(tokens) == SCRIPT[:6]


def test_completion_logprobs_legacy_format(srv, engine):
    r = srv.client().completions.create(model="fake-model", prompt="x", max_tokens=5, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == SCRIPT[:5]
    assert len(lp.token_logprobs) == 5 and lp.text_offset == [0, 1, 2, 3, 4]
    assert len(lp.top_logprobs[0]) == 3 and lp.top_logprobs[0][SCRIPT[0]] == lp.token_logprobs[0]


def test_n2_with_seed(srv, engine):
    r = srv.client().chat.completions.create(model="fake-model", messages=MSGS, n=2, seed=100, max_tokens=8,
                                             temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert sorted(p.seed for _, p in engine.requests[-2:]) == [100, 101]
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == len(engine.prompts[-1]) - 2
    spec = extra(r.usage, "speculative")
    assert spec["steps"] == 2 * extra(srv.client().chat.completions.create(
        model="fake-model", messages=MSGS, max_tokens=8).usage, "speculative")["steps"]


# ---------------------------------------------------------------- errors

ERROR_CASES = [
    # (path, body, status, param, code)
    ("/v1/chat/completions", {"model": "nope", "messages": MSGS}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages", None),
    ("/v1/chat/completions", {"model": "fake-model"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, 400,
     "messages", "images_not_supported"),  # a text-only model
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "messages[0].content[0].type", None),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 10**9}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 10**6}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": -1}, 400, "temperature", None),
    ("/v1/chat/completions", {"messages": MSGS, "top_p": 0}, 400, "top_p", None),
    ("/v1/chat/completions", {"messages": MSGS, "n": 9}, 400, "n", None),
    ("/v1/chat/completions", {"messages": MSGS, "n": 0}, 400, "n", None),
    ("/v1/chat/completions", {"messages": MSGS, "n": 9, "stream": True}, 400, "n", None),
    ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": MSGS, "stop": 5}, 400, "stop", None),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"a": 1}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"5": 1, "05": 2}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"5": "big"}}, 400, "logit_bias.5", None),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"+5": 1}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"\u0665": 1}}, 400, "logit_bias", None),
    # strict types: true is not 1, "2" is not 2
    ("/v1/chat/completions", {"messages": MSGS, "temperature": True}, 400, "temperature", None),
    ("/v1/chat/completions", {"messages": MSGS, "n": True}, 400, "n", None),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "stream": True, "stream_options": {"include_usage": "yes"}},
     400, "stream_options.include_usage", None),
    ("/v1/chat/completions", {"messages": MSGS, "model": 5}, 400, "model", None),
    ("/v1/completions", {"prompt": "x", "model": ["fake-model"]}, 400, "model", None),
    # the deepest failing member of a union names the field
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "messages[0].content[0].text", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0].text", None),
    ("/v1/chat/completions", {"messages": MSGS, "seed": 2 ** 64, "temperature": 1}, 400, "seed", None),
    ("/v1/chat/completions", {"messages": MSGS, "seed": -(2 ** 63) - 1}, 400, "seed", None),
    ("/v1/chat/completions", {"messages": MSGS, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs.messages", None),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "xml"}}, 400,
     "response_format.type", None),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"json_schema": {}}}, 400,
     "response_format.type", None),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format.json_schema.schema", None),
    # structured outputs need a tokenizer llguidance can read, which the fake engine's char tokenizer
    # (one word per character, fused) is not: a 400, not a 500 (tests/test_structured_server.py runs
    # them on real models)
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_object"}}, 400,
     "response_format", None),
    ("/v1/chat/completions", {"messages": MSGS, "guided_json": {"type": "object"}}, 400, "guided_json", None),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a", "b"]}, 400, "guided_choice", None),
    ("/v1/chat/completions", {"messages": MSGS, "structured_outputs": {"regex": "a+"}}, 400,
     "structured_outputs.regex", None),
    ("/v1/chat/completions", {"messages": MSGS, "guided_regex": 5}, 400, "guided_regex", None),
    # vLLM / legacy OpenAI fields that would change the result if ignored: refused unless at their default
    ("/v1/chat/completions", {"messages": MSGS, "use_beam_search": True}, 400, "use_beam_search", None),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", None),
    ("/v1/chat/completions", {"messages": MSGS, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "min_tokens": -1}, 400, "min_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "skip_special_tokens": "no"}, 400, "skip_special_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "echo": True}, 400, "echo", None),
    ("/v1/chat/completions", {"messages": MSGS, "continue_final_message": "yes"}, 400, "continue_final_message",
     None),
    ("/v1/chat/completions", {"messages": MSGS, "functions": [{"name": "f"}]}, 400, "functions", None),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix", None),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [-1, 5]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x" * 600}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt", None),
    ("/tokenize", {}, 400, "prompt", None),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]", None),
    ("/detokenize", {}, 400, "tokens", None),
]


@pytest.mark.parametrize("path,body,status,param,code", ERROR_CASES)
def test_error_cases(srv, engine, path, body, status, param, code):
    r = srv.http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    if code:
        assert err["code"] == code


@pytest.mark.parametrize("raw", [
    b"{not json", b"[1, 2]", b"", b"\xff\xfe",
    b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # a surrogate encoded in UTF-8: not UTF-8
    b'{"messages": [{"role": "user", "content": "hi"}], "model": "\xed\xa0\x80"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}",
], ids=["syntax", "array", "empty", "utf16-bom", "utf8-surrogate", "surrogate-model", "deep", "long-int"])
def test_invalid_json_bodies(srv, raw):
    """Each a 400 in OpenAI's shape (they were 500s: surrogates reached the tokenizer or the 404's
    message, deep nesting raised RecursionError); the server keeps serving."""
    r = srv.http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "set_int_max_str_digits" not in r.text
    ok = srv.http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_compressed_body_is_a_415(srv):
    r = srv.http.post("/v1/chat/completions", content=gzip.compress(json.dumps({"messages": MSGS}).encode()),
                      headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]["message"]


def test_seed_of_each_choice_wraps_in_64_bits(srv, engine):
    top = 2 ** 63 - 1
    r = srv.http.post("/v1/chat/completions", json={"messages": MSGS, "n": 2, "seed": top, "temperature": 1,
                                                    "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert [p.seed for _, p in engine.requests[-2:]] == [top, -(2 ** 63)]


def test_nulls_are_defaults_and_integral_floats_are_ints(srv, engine):
    """What float-only clients (JSON numbers from Go/JS arithmetic) and the openai client's explicit
    None send: accepted as vLLM does; 16.5 tokens or true stay refused."""
    body = {"messages": MSGS, "n": None, "stream": None, "ignore_eos": None, "add_generation_prompt": None,
            "stream_options": {"include_usage": None}, "max_tokens": 5.0, "seed": 7.0, "top_k": 3.0,
            "temperature": 1}
    r = srv.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    _, params = engine.requests[-1]
    assert (params.max_tokens, params.seed, params.top_k, params.temperature) == (5, 7, 3, 1.0)
    r = srv.http.post("/v1/completions", json={"prompt": "x", "echo": None, "logprobs": 2.0, "max_tokens": 2})
    assert r.status_code == 200, r.text
    for bad in ({"max_tokens": 5.5}, {"n": 2.5}, {"max_tokens": True}):
        assert srv.http.post("/v1/chat/completions", json={"messages": MSGS, **bad}).status_code == 400


def test_max_completion_tokens_named_in_its_error(srv):
    r = srv.http.post("/v1/chat/completions", json={"messages": MSGS, "max_completion_tokens": 0})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_completion_tokens"
    assert err["message"].startswith("max_completion_tokens must be >= 1")


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800 hi"}]}', "messages[0].content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "\uDC00"]}',
     "stop[1]"),
    ("/v1/completions", rb'{"prompt": "x \udfff"}', "prompt"),
    ("/tokenize", rb'{"prompt": "\ud83d"}', "prompt"),
])
def test_lone_surrogate_escapes_are_a_400(srv, engine, path, raw, param):
    """JSON can carry half a UTF-16 pair ("\ud800"), which is no text: a clear 400 (it reached the
    tokenizer as a 500); an escaped pair (an emoji) is fine."""
    r = srv.http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone UTF-16 surrogate" in err["message"]
    ok = srv.http.post("/v1/chat/completions", content=rb'{"messages": [{"role": "user", "content": '
                       rb'"\ud83d\ude00 hi"}], "max_tokens": 2}', headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_openai_client_sees_openai_errors(srv):
    c = srv.client()
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="fake-model", messages=MSGS, temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(model="gpt-4", messages=MSGS)
    assert info.value.body["code"] == "model_not_found"


def test_unknown_route_and_method(srv):
    r = srv.http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = srv.http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_engine_request_error_becomes_400_before_streaming(srv, engine):
    for stream in (False, True):
        engine.fail_next = RequestError("prompt too long for the KV pool", param="messages", code="too_long")
        r = srv.http.post("/v1/chat/completions", json={"messages": MSGS, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_long"
        assert r.json()["error"]["param"] == "messages"


def test_unexpected_exception_is_500_and_server_keeps_serving(srv, engine):
    engine.fail_next = RuntimeError("boom")
    r = srv.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "boom" not in r.text  # no internals leak
    assert srv.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_api_key():
    s = make_server(api_key="sekret")
    try:
        body = {"messages": MSGS, "max_tokens": 2}
        assert s.http.post("/v1/chat/completions", json=body).status_code == 401
        r = s.http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert s.http.get("/v1/models").status_code == 401
        assert s.http.get("/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        r = s.client("sekret").chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2)
        assert r.choices[0].message.content == SCRIPT[:2]
    finally:
        s.close()


def test_request_too_large():
    s = make_server(max_request_bytes=2000)
    try:
        big = {"messages": [{"role": "user", "content": "x" * 3000}]}
        r = s.http.post("/v1/chat/completions", json=big)  # Content-Length says it
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        payload = json.dumps(big).encode()

        def chunks():  # no Content-Length: the real size decides
            for i in range(0, len(payload), 500):
                yield payload[i:i + 500]

        r = s.http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        ok = json.dumps({"messages": MSGS, "max_tokens": 2}).encode()
        r = s.http.post("/v1/chat/completions", content=iter([ok[:10], ok[10:]]))
        assert r.status_code == 200
    finally:
        s.close()


# ---------------------------------------------------------------- disconnects

def test_disconnect_mid_stream_aborts_and_frees_blocks(srv, engine):
    engine.step_delay = 0.02
    free0 = engine.stats().kv_blocks_free
    stream = srv.client().chat.completions.create(model="fake-model", messages=MSGS, stream=True,
                                                  max_tokens=400, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 4:
            break
    assert engine.stats().kv_blocks_free < free0 and engine.stats().num_running == 1
    rid = engine.requests[-1][0]
    stream.close()
    assert wait_for(lambda: rid in engine.aborted), "engine never saw the abort"
    assert wait_for(lambda: engine.stats().kv_blocks_free == free0)
    assert engine.stats().num_running == 0 and rid not in engine.finished


def test_disconnect_non_streaming_aborts(srv, engine):
    engine.step_delay = 0.02
    free0 = engine.stats().kv_blocks_free
    with pytest.raises(httpx.ReadTimeout):
        srv.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 400, "ignore_eos": True, "n": 2},
                      timeout=0.3)
    assert wait_for(lambda: len(engine.aborted) >= 2 and engine.stats().kv_blocks_free == free0)
    assert engine.stats().num_running == 0


# ---------------------------------------------------------------- metrics

SPEC_COUNTERS = {"steps": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def _m(metrics, name, **labels):
    key = (name, tuple(sorted({"model_name": "served", **labels}.items())))
    return metrics.get(key, 0.0)


def test_metrics_spec_counters_match_usage():
    s = make_server(FakeEngine(accept_pattern=(3, 1, 0, 4, 2)), served_model_name="served")
    try:
        before = s.metrics()
        assert _m(before, "vllm:spec_decode_num_drafts_total") == 0  # exported before the first request
        assert ("vllm:kv_cache_usage_perc", (("model_name", "served"),)) in before
        c = s.client()
        usages = [c.chat.completions.create(model="served", messages=MSGS, n=2, max_tokens=30).usage,
                  c.completions.create(model="fake-model", prompt=["a", "b"], max_tokens=7).usage]
        stream = c.chat.completions.create(model="served", messages=MSGS, stream=True,
                                           stream_options={"include_usage": True})
        usages += [ch.usage for ch in stream if ch.usage]
        after = s.metrics()
        specs = [extra(u, "speculative") for u in usages]
        for field, name in SPEC_COUNTERS.items():
            assert _m(after, name) - _m(before, name) == sum(sp[field] for sp in specs), name
        per_pos = [sum(sp["accepted_per_pos"][i] for sp in specs if i < len(sp["accepted_per_pos"]))
                   for i in range(4)]
        for i, n in enumerate(per_pos):
            name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            assert _m(after, name, position=str(i)) - _m(before, name, position=str(i)) == n
        gen = _m(after, "vllm:generation_tokens_total") - _m(before, "vllm:generation_tokens_total")
        assert gen == sum(u.completion_tokens for u in usages)
        ok = sum(v for (name, labels), v in after.items() if name == "vllm:request_success_total")
        assert ok == 5  # 2 + 2 + 1 engine requests
        assert _m(after, "vllm:time_to_first_token_seconds_count") == 5
        assert _m(after, "vllm:e2e_request_latency_seconds_count") == 5
        assert _m(after, "vllm:kv_cache_usage_perc") == 0.0 and _m(after, "vllm:num_requests_running") == 0
    finally:
        s.close()


def test_metrics_export_the_engines_preemption_count():
    from specserve.engine.types import EngineStats
    from specserve.server.metrics import ServerMetrics

    stats = EngineStats(num_running=1, num_waiting=2, kv_blocks_total=10, kv_blocks_free=4, num_preemptions=3)
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'vllm:num_preemptions_total{model_name="m"} 3.0' in text
    assert 'vllm:num_requests_waiting{model_name="m"} 2.0' in text


def test_two_apps_in_one_process_have_separate_metrics():
    a, b = FakeEngine(), FakeEngine(spec=False)
    app_a, app_b = create_app(a, ServerConfig()), create_app(b, ServerConfig())
    a_text = app_a.state.ctx.metrics.render().decode()
    b_text = app_b.state.ctx.metrics.render().decode()
    assert "vllm:spec_decode_num_drafts_total" in a_text
    assert "vllm:spec_decode_num_drafts_total" not in b_text  # no speculation: no spec series at all


def test_log_line_per_finished_request(srv, engine):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("specserve.server")
    old_level = logger.level
    logger.addHandler(handler)  # directly on the logger: independent of propagation settings
    logger.setLevel(logging.INFO)
    try:
        srv.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=10)
        assert wait_for(lambda: any("draft acceptance =" in r.getMessage() for r in records))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    line = next(r.getMessage() for r in records if "draft acceptance" in r.getMessage())
    assert "completion 10 tok" in line and "prefill" in line and "decode" in line and "tok/s" in line
    assert line.startswith("request chatcmpl-")


# ---------------------------------------------------------------- chat templates

def test_default_template_kwargs_overridden_per_request():
    s = make_server(default_chat_template_kwargs={"greeting": "server"})
    try:
        c = s.client()
        c.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)
        assert "[greeting=server]" in s.engine.prompts[-1]
        c.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1,
                                  extra_body={"chat_template_kwargs": {"greeting": "client"}})
        assert "[greeting=client]" in s.engine.prompts[-1] and "server" not in s.engine.prompts[-1]
        r = s.http.post("/tokenize", json={"messages": MSGS, "chat_template_kwargs": {"greeting": "tok"}})
        toks = r.json()["tokens"]
        assert s.engine.tokenizer.decode(toks, False).endswith("[greeting=tok]<|assistant|>")
        assert r.json()["count"] == len(toks)
    finally:
        s.close()


def test_tokenize_detokenize(srv):
    r = srv.http.post("/tokenize", json={"prompt": "ab"}).json()
    assert r["tokens"] == [1, ord("a") + 3, ord("b") + 3] and r["count"] == 3
    r = srv.http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()
    assert r["count"] == 2
    assert srv.http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "ab"}


def test_model_without_template():
    s = make_server(FakeEngine(chat_template=None))
    try:
        r = s.http.post("/v1/chat/completions", json={"messages": MSGS})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "no chat template" in msg and "--chat-template" in msg and "/v1/completions" in msg
        assert s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        s.close()
    s = make_server(FakeEngine(chat_template=None), chat_template="{{ messages[0].content }}|")
    try:
        s.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)
        assert s.engine.prompts[-1] == "Hi|"
    finally:
        s.close()


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


# ---------------------------------------------------------------- the serve command

def test_serve_command_wiring(monkeypatch):
    from specserve.cli import main
    from specserve.commands import serve as serve_cmd

    started = {}
    fake_mod = types.ModuleType("specserve.engine.async_engine")
    fake_mod.AsyncEngine = FakeEngine
    monkeypatch.setitem(sys.modules, "specserve.engine.async_engine", fake_mod)
    def fake_run_server(server, engine, sock, drain=None):
        started.update(app=server.config.app, port=server.config.port, bound=sock.getsockname()[1])
        sock.close()
        return 0

    monkeypatch.setattr(serve_cmd, "run_server", fake_run_server)
    monkeypatch.setattr(serve_cmd, "_setup_logging", lambda level: None)  # keep the process's logging as is
    assert main(["serve", "--port", "8123", "--served-model-name", "x", "--reasoning-parser", "qwen3"]) == 0
    assert started["port"] == started["bound"] == 8123 and started["app"].state.ctx.served_model_name == "x"
    with socket.socket() as busy:  # a port in use fails before the model loads
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SpecserveError, match="cannot listen on 127.0.0.1"):
            serve_cmd.run(serve_cmd_args(["--port", str(busy.getsockname()[1])]))
    assert main(["serve", "--default-chat-template-kwargs", "{oops"]) == 1
    with tempfile.NamedTemporaryFile("w", suffix=".jinja") as empty:
        with pytest.raises(SpecserveError, match="is empty"):
            serve_cmd.run(serve_cmd_args(["--chat-template", empty.name]))
    with pytest.raises(SpecserveError, match="not valid JSON"):
        serve_cmd.run(serve_cmd_args(["--default-chat-template-kwargs", "{oops"]))

    lock_mod = types.ModuleType("specserve.lock")
    calls = []
    lock_mod.check_lock = lambda path, argv, allow: calls.append((path, argv, allow)) or ["model: a != b"]
    monkeypatch.setitem(sys.modules, "specserve.lock", lock_mod)
    import specserve

    monkeypatch.setattr(specserve, "lock", lock_mod, raising=False)  # `from specserve import lock` reads this
    monkeypatch.setattr(sys, "argv", ["specserve", "serve", "--lock", "l.json", "--lock-allow", "threads"])
    started.clear()
    assert main() == 3 and not started
    assert calls == [("l.json", ["--lock", "l.json", "--lock-allow", "threads"], ["threads"])]
    lock_mod.check_lock = lambda path, argv, allow: []
    assert main() == 0 and started


def serve_cmd_args(argv):
    from specserve.commands.args import build_serve_parser

    return build_serve_parser().parse_args(argv)


# ---------------------------------------------------------------- tool calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
# renders tools and a history's calls the way Qwen2.5's template does (arguments | tojson)
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n{% endfor %}assistant:"
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


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
    assert choice.finish_reason == "tool_calls" and msg.content == "Checking."
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Oslo"})]
    content, calls, finish = _stream_tools(c, tools=TOOLS)
    assert finish == "tool_calls" and content.strip() == "Checking."
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
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_tool_request_errors(tool_srv, body, param):
    r = tool_srv.http.post("/v1/chat/completions", json={"messages": MSGS, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_health_is_503_once_the_engine_cannot_go_on():
    """A tensor-parallel rank gone (AsyncEngine.fatal): /health says so until the process exits."""
    from specserve.parallel.group import ParallelError

    s = make_server()
    try:
        assert s.http.get("/health").json() == {"status": "ok"}
        s.engine.fatal = ParallelError("tensor-parallel rank 1 (pid 7) exited with code -9")
        r = s.http.get("/health")
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"]
    finally:
        s.close()


@pytest.mark.parametrize("kw, text", [
    (dict(stop=("scripted",)), "Hello there! This is a "),
    (dict(stop=("scripted",), include_stop_str_in_output=True), "Hello there! This is a scripted"),
    (dict(stop=("Hello",)), ""),
    (dict(stop=("Hello",), min_tokens=10), SCRIPT),  # the stop string ends before min_tokens: it does not count
])
def test_the_scripted_engine_stops_as_the_engine_does(kw, text):
    """The scripted engine is the real engine: stop strings, held-back text and min_tokens are cut by
    its detokenizer (engine/detokenizer.py), with drafts accepted several at a time."""
    import asyncio

    from specserve.engine.types import SamplingParams

    eng = FakeEngine()

    async def run() -> tuple[str, str | None]:
        await eng.start()
        out, reason = "", None
        try:
            async for o in eng.generate(eng.tokenizer.encode("hi"), SamplingParams(max_tokens=100, **kw), "r"):
                out, reason = out + o.new_text, o.finish_reason
        finally:
            await eng.shutdown()
        return out, reason

    assert asyncio.run(run()) == (text, "stop")
