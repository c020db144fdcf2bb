"""The HTTP server against a FakeEngine, over real HTTP (uvicorn in a thread).

The official ``openai`` client checks wire compatibility; ``httpx`` checks
error statuses and bodies, limits and disconnects.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import tempfile
import types

import httpx
import pytest

from fake_engine import SCRIPT, SCRIPT_TOKENS, FakeEngine
from live_server import MSGS, extra, make_server, wait_for
from specserve.errors import SpecserveError
from specserve.server.app import create_app
from specserve.server.config import ServerConfig


# ---------------------------------------------------------------- basics

def test_models_health_version(srv):
    models = srv.client().models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert srv.http.get("/health").status_code == 200
    assert srv.http.get("/v1/health").json() == srv.http.get("/health").json()  # llama-server's alias
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


def test_assistant_refusal_part_reads_as_its_text(srv, engine):
    """OpenAI's assistant content takes refusal parts: a conversation replayed with one reads it as the
    turn's text (a user's refusal part is a 400, tests/test_server_errors.py)."""
    msgs = [*MSGS, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            {"role": "user", "content": "Why?"}]
    r = srv.http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert engine.prompts[-1] == "<s><|user|>Hi\n<|assistant|>No.\n<|user|>Why?\n<|assistant|>"


def test_structured_outputs_on_any_vocabulary(srv):
    """llguidance reads the vocabulary token by token (server/structured.py), so the fake engine's
    one-character tokenizer, which it could not read as a tokenizer.json, constrains too."""
    r = srv.http.post("/v1/completions", json={"prompt": "x", "guided_choice": ["ab", "ba"], "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("ab", "ba"), r.text
    r = srv.http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 6,
                                                    "structured_outputs": {"regex": "a+"}})
    assert r.status_code == 200 and set(r.json()["choices"][0]["message"]["content"]) == {"a"}, r.text


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
            "bad_words": [], "length_penalty": 1.0, "some_future_field": 1, "grammar": ""}
    with caplog.at_level(logging.INFO, logger="specserve.server"):
        r = srv.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert "request fields ignored: some_future_field\n" in caplog.text + "\n"  # grammar is read, not ignored


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


def test_chat_without_max_tokens_may_fill_a_pool_of_one_sequence():
    """A chat request without max_tokens is given the rest of the context; a KV pool of exactly one
    max-length sequence (--max-num-seqs 1) serves it to the end, drafts included (they are capped by
    the tokens left), instead of refusing it for the draft rows it never writes."""
    eng = FakeEngine(max_model_len=128, kv_blocks=8, block_size=16, responder=lambda prompt, params: "x" * 300)
    server = make_server(eng)
    try:
        assert eng.engine.blocks.num_blocks * 16 == 128
        r = server.client().chat.completions.create(model="fake-model", messages=MSGS)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 128
    finally:
        server.close()


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


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_continuous_usage_stats(srv, engine, kind):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (its
    completion tokens never falling, the last content chunk's equal to the final usage); without
    include_usage it does nothing, as in vLLM."""
    c = srv.client()
    make = (lambda **kw: c.chat.completions.create(model="fake-model", messages=MSGS, stream=True, **kw)) \
        if kind == "chat" else (lambda **kw: c.completions.create(model="fake-model", prompt="p", max_tokens=20,
                                                                   stream=True, **kw))
    chunks = list(make(stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage is not None for ch in chunks) and counts == sorted(counts)
    assert kind == "completions" or counts[0] == 0  # the role chunk: before any output, as vLLM
    assert chunks[-1].choices == [] and counts[-2] == counts[-1] == (SCRIPT_TOKENS if kind == "chat" else 20)
    assert all(ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for ch in chunks)
    plain = list(make(stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(ch.usage is None for ch in plain)


def test_stream_raw_sse_ends_with_done(srv, engine):
    body = {"model": "fake-model", "messages": MSGS, "stream": True, "max_tokens": 6}
    with srv.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "timings" in events[-1] and events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events)  # no include_usage: no usage fields at all


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": MSGS}),
                                       ("/v1/completions", {"prompt": "Once"}), ("/completion", {"prompt": "Once"})])
def test_stream_headers_before_the_first_token(srv, engine, path, body):
    """A stream's status line and headers come before its first output (vLLM's come at once): a long
    prefill or a queue does not run into a client's first-byte timeout. Here no engine step runs
    until the headers are in; the events follow."""
    held = engine.hold_steps()
    with srv.http.stream("POST", path, json={**body, "stream": True, "max_tokens": 4}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert not any(s.output_ids for s in engine.engine.running)  # the headers came before any output
        held.clear()
        lines = [line for line in r.iter_lines() if line]
    assert lines and all(line.startswith("data: ") for line in lines)


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
    assert r.choices[0].stop_reason == "scripted"  # vLLM's field: which stop string ended it
    stream = list(c.chat.completions.create(model="fake-model", messages=MSGS, stop="This", stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == "Hello there! " and stream[-1].choices[0].stop_reason == "This"
    done = c.completions.create(model="fake-model", prompt="x", stop=["zz"], max_tokens=100)  # EOS: none
    assert done.choices[0].finish_reason == "stop" and done.choices[0].stop_reason is None
    stream = list(c.completions.create(model="fake-model", prompt="x", stop=["is a"], max_tokens=100, stream=True))
    assert [ch.choices[0].stop_reason for ch in stream if ch.choices][-1] == "is a"


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


def test_completion_echo_with_logprobs_scores_the_prompt(srv, engine):
    """echo + logprobs (what loglikelihood evaluations send): the prompt's tokens and logprobs come
    first, the first token without one; max_tokens 0 gives the prompt alone; vLLM's prompt_logprobs
    field carries the same numbers; streamed, the same tokens."""
    c = srv.client()
    r = c.completions.create(model="fake-model", prompt="Echo me", max_tokens=0, echo=True, logprobs=2)
    ch, lp = r.choices[0], r.choices[0].logprobs
    assert (ch.text, ch.finish_reason, r.usage.completion_tokens) == ("Echo me", "length", 0)
    assert engine.requests[-1][1].prompt_logprobs == 2
    assert lp.tokens == ["<s>", *"Echo me"] and lp.text_offset == [0, 0, 1, 2, 3, 4, 5, 6]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert all(t[tok] == v for t, tok, v in zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:]))

    r = c.completions.create(model="fake-model", prompt="Echo me", max_tokens=3, echo=True, logprobs=1,
                             extra_body={"prompt_logprobs": 1})
    ch, lp2 = r.choices[0], r.choices[0].logprobs
    assert ch.text == "Echo me" + SCRIPT[:3] and lp2.tokens == lp.tokens + list(SCRIPT[:3])
    assert lp2.token_logprobs[:8] == lp.token_logprobs and lp2.text_offset[8:] == [7, 8, 9]
    vllm = extra(ch, "prompt_logprobs")
    assert vllm[0] is None and len(vllm) == 8
    for entry, tok, value in zip(vllm[1:], lp.tokens[1:], lp.token_logprobs[1:]):
        mine = entry[str(ord(tok) + 3)]  # CharTokenizer: a character's id is its code + 3
        assert (mine["decoded_token"], mine["logprob"]) == (tok, value) and mine["rank"] >= 1
        assert 1 <= len(entry) <= 2

    stream = c.completions.create(model="fake-model", prompt="Echo me", max_tokens=3, echo=True, logprobs=1,
                                  stream=True)
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(x.text for x in chunks) == "Echo me" + SCRIPT[:3]
    assert [t for x in chunks if x.logprobs for t in x.logprobs.tokens] == lp2.tokens
    assert [o for x in chunks if x.logprobs for o in x.logprobs.text_offset] == lp2.text_offset


def test_chat_prompt_logprobs_beside_the_choices(srv, engine):
    """vLLM's chat prompt_logprobs: one list beside the choices (they share the prompt), computed by
    the first choice; the rendered prompt's tokens, the first without one."""
    r = srv.http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "n": 2, "prompt_logprobs": 1})
    body = r.json()
    lps, chars = body["prompt_logprobs"], engine.prompts[-1].removeprefix("<s>")  # BOS, then a token a character
    assert r.status_code == 200 and lps[0] is None and len(lps) == 1 + len(chars)
    assert [e[str(ord(ch) + 3)]["decoded_token"] for e, ch in zip(lps[1:], chars)] == list(chars)
    assert [p.prompt_logprobs for _, p in engine.requests[-2:]] == [1, None]
    assert [c["message"]["content"] for c in body["choices"]] == [SCRIPT[:2]] * 2


def test_n2_with_seed(srv, engine):
    r = srv.client().chat.completions.create(model="fake-model", messages=MSGS, n=2, seed=100, max_tokens=8,
                                             temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert sorted(p.seed for _, p in engine.requests[-2:]) == [100, 101]
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == len(engine.prompts[-1]) - 2
    spec = extra(r.usage, "speculative")
    assert spec["steps"] == 2 * extra(srv.client().chat.completions.create(
        model="fake-model", messages=MSGS, max_tokens=8).usage, "speculative")["steps"]


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


def test_llama_server_props(srv, engine):
    """GET /props: what llama-server's clients read (context size, template, default sampling)."""
    r = srv.http.get("/props").json()
    assert r["default_generation_settings"]["n_ctx"] == engine.max_model_len
    assert r["default_generation_settings"]["params"]["temperature"] == 0.8 and r["total_slots"] >= 1
    assert r["model_alias"] == "fake-model" and r["chat_template"] == engine.tokenizer.chat_template
    assert r["modalities"] == {"vision": False, "video": False, "audio": False}
    assert not r["endpoint_props"]  # (no POST /props)


def test_tokenize_detokenize(srv):
    r = srv.http.post("/tokenize", json={"prompt": "ab"}).json()
    assert r["tokens"] == [1, ord("a") + 3, ord("b") + 3] and r["count"] == 3
    r = srv.http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()
    assert r["count"] == 2
    assert srv.http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "ab", "content": "ab"}
    # llama-server's form: content, BOS only with add_special, with_pieces
    assert srv.http.post("/tokenize", json={"content": "ab"}).json()["tokens"] == [ord("a") + 3, ord("b") + 3]
    r = srv.http.post("/tokenize", json={"content": "ab", "add_special": True, "with_pieces": True}).json()
    assert [p["id"] for p in r["tokens"]] == [1, ord("a") + 3, ord("b") + 3] and r["tokens"][1]["piece"] == "a"
    r = srv.http.post("/tokenize", json={"content": "<s>a"}).json()
    assert r["tokens"] == [1, ord("a") + 3]  # parse_special (default true): <s> is the token
    r = srv.http.post("/tokenize", json={"content": "<s>a", "parse_special": False}).json()
    assert r["tokens"] == [ord(ch) + 3 for ch in "<s>a"]  # its characters
    r = srv.http.post("/tokenize", json={"content": "ab", "prompt": "ab"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # llama-server's /apply-template: the rendered chat prompt, the text /tokenize counts
    text = srv.http.post("/apply-template", json={"messages": MSGS}).json()["prompt"]
    ids = srv.http.post("/tokenize", json={"messages": MSGS}).json()["tokens"]
    assert srv.http.post("/detokenize", json={"tokens": ids}).json()["content"] == text
    r = srv.http.post("/apply-template", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


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


# ---------------------------------------------------------------- the serve command

def test_serve_command_wiring(monkeypatch, caplog):
    import logging

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
    with socket.socket() as probe:  # a port free now (a fixed one may be taken on the machine)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="specserve.server"):
        assert main(["serve", "--port", str(port), "--served-model-name", "x", "--reasoning-parser", "qwen3"]) == 0
    assert started["port"] == started["bound"] == port and started["app"].state.ctx.served_model_name == "x"
    # the fake model's tokenizer spells <think> out in characters: said at start-up
    assert "--reasoning-parser qwen3: the model's tokenizer has no <think> or </think> token" in caplog.text
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


def test_an_abort_before_the_first_token_is_counted_and_logged(caplog):
    """A client gone while its request waits for its first step (no output yet) is an abort in
    request_success_total and the e2e histogram, and a log line, as one gone later is."""
    import logging

    eng = FakeEngine(step_delay=0.3)  # every step of a busy engine waits: the new request's first one too
    s = make_server(eng, served_model_name="served")
    busy = s.client().completions.create(model="served", prompt="a", max_tokens=400, stream=True,
                                         extra_body={"ignore_eos": True})
    try:
        next(iter(busy))
        body = json.dumps({"prompt": "x", "max_tokens": 4}).encode()
        with caplog.at_level(logging.INFO, logger="specserve.server"):
            with socket.create_connection(("127.0.0.1", s.port)) as client:  # sent, then closed at once
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                assert wait_for(lambda: len(eng.requests) == 2)
            assert wait_for(lambda: len(eng.aborted) == 1)
            assert wait_for(lambda: _m(s.metrics(), "vllm:request_success_total", finished_reason="abort") == 1)
        assert _m(s.metrics(), "vllm:e2e_request_latency_seconds_count") == 1
        assert eng.aborted == [eng.requests[1][0]] and "aborted before its first token" in caplog.text
    finally:
        busy.close()
        s.close()


def test_a_request_in_its_first_forward_counts_as_running():
    """/metrics while a request's first forward computes (a long prompt's first prefill chunk can
    take seconds): running, its K/V reserved, not waiting (as vLLM counts a scheduled prefill)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    eng = FakeEngine()
    s = make_server(eng, served_model_name="served")
    entered, release = threading.Event(), threading.Event()
    run = eng.engine.runner.run

    def held_run(rows):
        entered.set()
        release.wait(10)
        return run(rows)

    eng.engine.runner.run = held_run
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(s.http.post, "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert entered.wait(10)
            m = s.metrics()
            assert _m(m, "vllm:num_requests_running") == 1 and _m(m, "vllm:num_requests_waiting") == 0
            assert _m(m, "vllm:kv_cache_usage_perc") > 0
            release.set()
            assert answer.result(10).status_code == 200
    finally:
        release.set()
        s.close()
