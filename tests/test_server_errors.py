"""The HTTP server's answers to bad requests: OpenAI-style 4xx JSON errors (status, param, code), limits,
authentication, and a server that keeps serving after them."""

from __future__ import annotations

import gzip
import json

import openai
import pytest

from fake_engine import SCRIPT
from live_server import MSGS, make_server
from specserve.errors import RequestError


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
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
     400, "messages[0].content[0].type", None),  # a refusal part: an assistant's only
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}, *MSGS]}, 400,
     "messages[0].content[0].refusal", None),
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
    ("/v1/chat/completions", {"messages": MSGS, "guided_regex": 5}, 400, "guided_regex", None),
    # vLLM / legacy OpenAI fields that would change the result if ignored: refused unless at their default
    ("/v1/chat/completions", {"messages": MSGS, "use_beam_search": True}, 400, "use_beam_search", None),
    ("/v1/chat/completions", {"messages": MSGS, "modalities": ["text", "audio"]}, 400, "modalities", None),
    ("/v1/chat/completions", {"messages": MSGS, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio", None),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", None),
    # llama-server's samplers we do not have: refused when on (llama.cpp clients send them to /completion)
    ("/completion", {"prompt": "x", "mirostat": 2}, 400, "mirostat", None),
    ("/completion", {"prompt": "x", "typical_p": 0.9}, 400, "typical_p", None),
    ("/completion", {"prompt": "x", "dry_multiplier": 0.8}, 400, "dry_multiplier", None),
    ("/v1/chat/completions", {"messages": MSGS, "xtc_probability": 0.5}, 400, "xtc_probability", None),
    ("/completion", {"prompt": "x", "top_n_sigma": 1.0}, 400, "top_n_sigma", None),
    ("/completion", {"prompt": "x", "dynatemp_range": 0.5}, 400, "dynatemp_range", None),
    ("/v1/chat/completions", {"messages": MSGS, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "min_tokens": -1}, 400, "min_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "skip_special_tokens": "no"}, 400, "skip_special_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "echo": True}, 400, "echo", None),
    ("/v1/chat/completions", {"messages": MSGS, "continue_final_message": "yes"}, 400, "continue_final_message",
     None),
    ("/v1/chat/completions", {"messages": MSGS, "functions": [{"name": "f"}]}, 400, "functions", None),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix", None),
    ("/v1/chat/completions", {"messages": MSGS, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", None),
    ("/v1/chat/completions", {"messages": MSGS, "prompt_logprobs": -1}, 400, "prompt_logprobs", None),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1, "echo": True}, 400, "max_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "stream_options": {"include_usage": True}}, 400, "stream_options",
     None),
    ("/v1/completions", {"prompt": "x", "stream": False, "stream_options": {}}, 400, "stream_options", None),
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
            "stream_options": None, "max_tokens": 5.0, "seed": 7.0, "top_k": 3.0,
            "temperature": 1}
    r = srv.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    _, params = engine.requests[-1]
    assert (params.max_tokens, params.seed, params.top_k, params.temperature) == (5, 7, 3, 1.0)
    r = srv.http.post("/v1/completions", json={"prompt": "x", "echo": None, "logprobs": 2.0, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = srv.http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "stream": True,
                                                    "stream_options": {"include_usage": None}})
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


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": MSGS}),
                                        ("/v1/completions", {"prompt": "x"})])
def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event(srv, engine, monkeypatch, path, body):
    """The status line is out (200), so the failure is reported in the stream: an OpenAI error event
    (no internals), then [DONE]; the next request is served."""
    real = engine.generate

    async def fails_after_two(*args, **kw):
        n = 0
        async for out in real(*args, **kw):
            yield out
            n += 1
            if n == 2:
                raise RuntimeError("boom")

    monkeypatch.setattr(engine, "generate", fails_after_two)
    r = srv.http.post(path, json={**body, "stream": True, "max_tokens": 20})
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error" and "boom" not in r.text
    assert len(events) > 3  # some chunks came before the error
    monkeypatch.undo()
    assert srv.http.post(path, json={**body, "max_tokens": 2}).status_code == 200


def test_api_key():
    s = make_server(api_keys=("sekret", "second"))
    try:
        body = {"messages": MSGS, "max_tokens": 2}
        assert s.http.post("/v1/chat/completions", json=body).status_code == 401
        r = s.http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "X-Api-Key" in r.json()["error"]["message"]
        assert s.http.get("/v1/models").status_code == 401
        assert s.http.get("/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        r = s.client("sekret").chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2)
        assert r.choices[0].message.content == SCRIPT[:2]
        # llama-server's forms: the bare key, Anthropic's X-Api-Key; either of several keys
        for headers in ({"Authorization": "second"}, {"X-Api-Key": "sekret"}, {"x-api-key": "second"},
                        {"Authorization": "bearer  sekret"}):
            assert s.http.get("/v1/models", headers=headers).status_code == 200, headers
        for headers in ({"X-Api-Key": "wrong"}, {"Authorization": "Basic sekret"}, {"Authorization": "Bearer"},
                        {"Authorization": "Bearer sekret,second"}, {"X-Api-Key": ""}):
            assert s.http.get("/v1/models", headers=headers).status_code == 401, headers
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
