"""Fill-in-the-middle: the infill tokens found in the catalog's vocabularies, the /infill prompt
(repository format, what is cut when it does not fit) on Qwen2.5-Coder's real tokenizer, and the
400s of a model without infill tokens (the fake engine's). The real model's infill over HTTP is in
test_server_live.py."""

from __future__ import annotations

import json

import pytest

from specserve.models.fim import find_fim_tokens, fim_prompt
from specserve.models.loader import load_tokenizer
from specserve.server.serving_infill import InfillRequest, build_prompt


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer("qwen2.5-coder-0.5b")


def test_fim_tokens_of_the_catalog(qwen):
    fim = find_fim_tokens(qwen)
    names = {k: qwen.id_to_token(getattr(fim, k)) for k in ("prefix", "suffix", "middle", "pad", "repo", "file_sep")}
    assert names == {"prefix": "<|fim_prefix|>", "suffix": "<|fim_suffix|>", "middle": "<|fim_middle|>",
                     "pad": "<|fim_pad|>", "repo": "<|repo_name|>", "file_sep": "<|file_sep|>"}
    assert set(fim.end_ids) == {fim.pad, fim.repo, fim.file_sep}
    # smollm2 has <repo_name> and <file_sep> but no prefix/suffix/middle: no infill
    assert find_fim_tokens(load_tokenizer("smollm2-135m")) is None
    assert fim_prompt(fim, [7, 8], [9], bos=1) == [1, fim.prefix, 7, 8, fim.suffix, 9, fim.middle]


def test_infill_prompt_in_the_repository_format(qwen):
    fim = find_fim_tokens(qwen)
    req = InfillRequest(input_prefix="def f(x):\n", prompt="    return ", input_suffix="\n\nprint(f(2))\n",
                        input_extra=[{"filename": "a.py", "text": "A = 1\n"}, {"text": "B = 2\n"}])
    p = build_prompt(qwen, req, fim, room=1000)
    assert not p.truncated
    assert qwen.decode(p.ids, skip_special_tokens=False) == (
        "<|repo_name|>myproject\n<|file_sep|>a.py\nA = 1\n<|file_sep|>tmp\nB = 2\n<|file_sep|>filename\n"
        "<|fim_prefix|>def f(x):\n    return <|fim_suffix|>\n\nprint(f(2))\n<|fim_middle|>")


def test_what_does_not_fit_is_cut(qwen):
    """Whole extra files go first (the earliest), then the suffix's end, then the prefix's start; the
    text nearest the cursor stays."""
    fim = find_fim_tokens(qwen)
    prefix = "".join(f"line_{i} = {i}\n" for i in range(200))
    suffix = "".join(f"after_{i} = {i}\n" for i in range(200))
    files = [{"filename": f"f{i}.py", "text": f"value_{i} = {i}\n" * 5} for i in range(3)]
    full = build_prompt(qwen, InfillRequest(input_prefix=prefix, input_suffix=suffix, input_extra=files), fim, 10**6)
    assert not full.truncated
    for room in (len(full.ids) - 10, 1500, 400, 40):
        p = build_prompt(qwen, InfillRequest(input_prefix=prefix, input_suffix=suffix, input_extra=files), fim, room)
        assert p.truncated and len(p.ids) <= room, room
        text = qwen.decode(p.ids, skip_special_tokens=False)
        before, after = text.split("<|fim_prefix|>")[1].split("<|fim_suffix|>")
        assert prefix.endswith(before) and suffix.startswith(after.removesuffix("<|fim_middle|>"))
        if "<|repo_name|>" in text:  # files kept are the last ones, whole
            assert "value_2 = 2\n" * 5 in text and "<|file_sep|>f0.py" not in text
        if room <= 400:
            assert "<|repo_name|>" not in text and len(after) > 0  # the suffix keeps a quarter of the room
    assert build_prompt(qwen, InfillRequest(input_prefix=prefix), fim, 40).ids[-1] == fim.middle


def test_a_model_without_infill_tokens_is_a_400(srv):
    r = srv.http.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    r = srv.http.post("/v1/completions", json={"prompt": "def f(", "suffix": ")", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    r = srv.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "suffix": ")"})
    assert r.status_code == 400 and "/v1/completions only" in r.json()["error"]["message"]
    assert srv.http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_n_indent_and_the_time_limit_end_an_infill():
    from specserve.server.serving_infill import Limits
    from specserve.server.streaming import Choice

    def choice(text):
        return Choice(index=0, prompt_index=0, prompt_ids=[1], params=None, request_id="r", text=text,
                      token_ids=[5])

    c = choice("x + 1\n        y = 2\n    return y\n")
    assert not Limits(4, 0).reached(c) and c.finish_reason is None  # every later line indented >= 4
    c = choice("x + 1\n        y = 2\n\nprint(y)\n")
    assert Limits(4, 0).reached(c) and c.text == "x + 1\n        y = 2\n\n" and c.finish_reason == "length"
    c = choice("x + 1\nprint(y")  # the short line is not complete yet: nothing cut
    assert not Limits(4, 0).reached(c) and c.text == "x + 1\nprint(y"
    limits = Limits(0, 1e-6)
    assert not limits.reached(choice("x + 1"))  # no new line yet: the time limit waits for one
    assert limits.reached(choice("x + 1\n  y")) and not Limits(0, 0).reached(choice("x\ny\n"))


def test_llama_server_completion_endpoint(srv, engine):
    """POST /completion answers in llama-server's format (content, stop_type, tokens, timings), streamed
    as data: events; a token-id prompt works; n_predict limits; bad values are 400s; llama-server's
    fields we do not act on are ignored."""
    from fake_engine import SCRIPT

    r = srv.http.post("/completion", json={"prompt": "Hi", "temperature": 0, "cache_prompt": True}).json()
    assert r["content"] == SCRIPT and r["stop_type"] == "eos" and r["stop"] and not r["truncated"]
    assert r["tokens_predicted"] == r["timings"]["predicted_n"] == len(SCRIPT) + 1 and r["tokens_evaluated"] == 3
    r = srv.http.post("/completion", json={"prompt": [1, 75, 108], "n_predict": 5, "temperature": 0}).json()
    assert r["content"] == SCRIPT[:5] and r["stop_type"] == "limit" and r["tokens_evaluated"] == 3
    cases = (({"max_tokens": 3}, 3), ({"n_predict": 4, "max_tokens": 3}, 4), ({"n_predict": -1, "max_tokens": 3}, None))
    for body, n in cases:
        r = srv.http.post("/completion", json={"prompt": "Hi", "temperature": 0, **body}).json()  # n_predict first
        assert r["content"] == (SCRIPT if n is None else SCRIPT[:n]), body
    with srv.http.stream("POST", "/completion", json={"prompt": "Hi", "stream": True, "stop": ["!"]}) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line]
    assert "".join(e["content"] for e in events) == SCRIPT[:SCRIPT.index("!")]
    assert events[-1]["stop"] and events[-1]["stop_type"] == "word" and events[-1]["stopping_word"] == "!"
    # n_probs: each generated token's logprob and the top n's (completion_probabilities); return_tokens
    r = srv.http.post("/completion", json={"prompt": "Hi", "n_predict": 6, "n_probs": 3, "return_tokens": True,
                                           "temperature": 0}).json()
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == r["tokens"] and len(r["tokens"]) == 6 and r["content"] == SCRIPT[:6]
    assert all(len(p["top_logprobs"]) == 3 and p["logprob"] <= 0 and set(p) == {"id", "token", "bytes", "logprob",
                                                                                  "top_logprobs"} for p in probs)
    assert "".join(p["token"] for p in probs) == SCRIPT[:6] and probs[0]["bytes"] == list(SCRIPT[0].encode())
    with srv.http.stream("POST", "/completion", json={"prompt": "Hi", "stream": True, "n_predict": 6, "n_probs": 2,
                                                      "temperature": 0}) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line]
    streamed = [p for e in events for p in e.get("completion_probabilities", [])]
    assert [p["id"] for p in streamed] == [p["id"] for p in probs] and "completion_probabilities" not in events[-1]
    assert [t for e in events for t in e["tokens"]] == [p["id"] for p in probs]  # as llama-server: each event's ids
    assert "completion_probabilities" not in srv.http.post("/completion", json={"prompt": "Hi", "n_predict": 2}).json()
    for bad, param in (({"n_probs": 21}, "n_probs"), ({"n_probs": -1}, "n_probs"),
                       ({"n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs")):
        r = srv.http.post("/completion", json={"prompt": "Hi", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    # a negative temperature is greedy in llama-server (its clients send -1 for greedy with probabilities)
    r = srv.http.post("/completion", json={"prompt": "Hi", "n_predict": 3, "temperature": -1})
    assert r.status_code == 200 and engine.requests[-1][1].temperature == 0.0, r.text
    # response_fields (llama.vim sends them): the final answer keeps those paths, as flat keys
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "no/such"]
    r = srv.http.post("/completion", json={"prompt": "Hi", "n_predict": 4, "response_fields": fields}).json()
    assert set(r) == {"content", "timings/prompt_n", "timings/predicted_n", "truncated"} and r["timings/predicted_n"] == 4
    with srv.http.stream("POST", "/completion", json={"prompt": "Hi", "n_predict": 4, "stream": True,
                                                      "response_fields": fields}) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line]
    assert set(events[-1]) == set(r) and "stop" in events[0]  # the deltas as they were
    # llama-server's other samplers at their off values (as its clients send them) are fine
    off = {"mirostat": 0, "typical_p": 1.0, "dynatemp_range": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
           "top_n_sigma": -1.0}
    assert srv.http.post("/completion", json={"prompt": "Hi", "n_predict": 2, **off}).status_code == 200
    # llama-server's logit_bias list: a token id, a text (each of its tokens), false bans
    tok = engine.tokenizer
    r = srv.http.post("/completion", json={"prompt": "Hi", "n_predict": 2, "logit_bias": [[7, False], ["ab", 1.5]]})
    assert r.status_code == 200, r.text
    want = {7: -100.0, **{t: 1.5 for t in tok.encode("ab", add_special_tokens=False)}}
    assert dict(engine.requests[-1][1].logit_bias) == want
    for bad in ([[7]], [[True, 1.0]], [["", 1.0]], [[7, "x"]]):
        r = srv.http.post("/completion", json={"prompt": "Hi", "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (bad, r.text)
    # n_predict 0: the prompt alone, evaluated into the prefix cache (llama.vim's ring-buffer requests)
    r = srv.http.post("/completion", json={"prompt": "Hi", "n_predict": 0}).json()
    assert r["content"] == "" and r["tokens_predicted"] == 0 and r["stop_type"] == "limit"
    assert r["tokens_evaluated"] == 3
    with srv.http.stream("POST", "/completion", json={"prompt": "Hi", "n_predict": 0, "stream": True}) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line]
    assert [e["content"] for e in events] == [""] and events[-1]["stop"] and events[-1]["tokens_predicted"] == 0
    for bad, param in (({"prompt": "Hi", "n_predict": -2}, "n_predict"), ({"prompt": []}, "prompt"),
                       ({"prompt": "Hi", "n_predict": 10**6}, "n_predict"), ({"prompt": [10**9]}, "prompt")):
        r = srv.http.post("/completion", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_completion_with_several_prompts():
    """As llama-server's /completion: a list of prompts (texts and/or token-id lists) runs at once and
    answers with an array in prompt order, or one stream whose events carry each prompt's index and end
    with a final event per prompt. A prompt that reaches its own limit (t_max_predict_ms here) stops
    alone, aborted in the engine, while the others run on. Texts and ids mixed in one prompt: a 400."""
    from fake_engine import SCRIPT, FakeEngine
    from live_server import make_server

    lines = "a = 1\n" * 40
    eng = FakeEngine(step_delay=0.005, responder=lambda prompt, params: lines if prompt.endswith("A") else SCRIPT)
    s = make_server(eng)
    try:
        body = {"prompt": ["A", "B", [1, 75, 108]], "n_predict": 30, "temperature": 0}
        r = s.http.post("/completion", json=body).json()
        assert [x["index"] for x in r] == [0, 1, 2] and [x["content"] for x in r] == [lines[:30], SCRIPT[:30],
                                                                                     SCRIPT[:30]]
        assert [x["tokens_evaluated"] for x in r] == [2, 2, 3] and all(x["stop_type"] == "limit" for x in r)
        late = {"prompt": ["A", "B"], "n_predict": 30, "temperature": 0, "t_max_predict_ms": 1}
        r = s.http.post("/completion", json=late).json()
        assert "\n" in r[0]["content"] and len(r[0]["content"]) < 30 and r[0]["stop_type"] == "limit"
        assert r[1]["content"] == SCRIPT[:30]  # no new line: the time limit never applies
        with s.http.stream("POST", "/completion", json={**late, "stream": True}) as st:
            events = [json.loads(line[len("data: "):]) for line in st.iter_lines() if line]
        finals = {e["index"]: e for e in events if e["stop"]}
        assert set(finals) == {0, 1} and all(e["stop_type"] == "limit" for e in finals.values())
        text = {i: "".join(e["content"] for e in events if e["index"] == i) for i in (0, 1)}
        assert "\n" in text[0] and len(text[0]) < 30 and text[1] == SCRIPT[:30]
        assert events.index(finals[0]) < events.index(finals[1])  # A stopped while B went on
        assert sum(rid.endswith("-0") for rid in eng.aborted) == 2  # stopped in the engine, both times
        r = s.http.post("/completion", json={"prompt": ["A", 75]})
        assert r.status_code == 400 and "mixed" in r.json()["error"]["message"], r.text
        r = s.http.post("/completion", json={"prompt": ["A", [10**9]]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
    finally:
        s.close()


@pytest.mark.parametrize("path,done", [("/completion", False), ("/v1/completions", True)])
def test_engine_failure_after_the_headers_is_an_error_event(srv, engine, path, done):
    """A failure once a stream's headers are out (here no step runs until they are; then the step
    fails) ends the stream with an error event: on llama-server's /completion as on OpenAI's
    endpoints, [DONE] after it on OpenAI's only."""
    held, step = engine.hold_steps(), engine.engine.run_step

    def failing(rows):
        engine.engine.run_step = step
        raise RuntimeError("step failed")

    engine.engine.run_step = failing
    try:
        with srv.http.stream("POST", path, json={"prompt": "Hi", "stream": True, "max_tokens": 4}, timeout=30) as r:
            assert r.status_code == 200
            held.clear()
            lines = [line for line in r.iter_lines() if line]
    finally:
        engine.engine.run_step = step
    assert json.loads(lines[-2 if done else -1][6:])["error"]["code"] == "internal_error"
    assert (lines[-1] == "data: [DONE]") == done
