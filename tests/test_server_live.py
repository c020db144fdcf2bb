"""``specserve serve`` as a subprocess with the real engine, driven by the official openai client.

Skipped while specserve.engine.async_engine cannot be imported. Needs the
smollm2-135m catalog model (fetched on first use), hence ``slow``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

try:
    import specserve.engine.async_engine  # noqa: F401
except Exception as exc:  # noqa: BLE001 - any import failure means "not built yet"
    pytest.skip(f"the real engine is not available yet (specserve.engine.async_engine: {exc})",
                allow_module_level=True)

import openai
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
# a fixed draft length: the adaptive policy's choices depend on timings (a short answer on a busy
# machine may never draft), and these tests need speculation to happen
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
STARTUP_TIMEOUT = 600
REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subprocess:
    def __init__(self, *flags: str, model: str = MODEL):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="specserve-live-", delete=False)
        cmd = [sys.executable, "-m", "specserve", "serve", "--model", model, "--port", str(self.port), *flags]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self._wait_ready()
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} during startup:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        pytest.fail(f"server not ready after {STARTUP_TIMEOUT}s:\n{self.output()}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def metrics(self) -> dict[str, float]:
        """Samples summed over labels other than model_name, keyed by name (and position for per-pos)."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
        return out

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
                return m
            assert time.monotonic() < deadline, f"engine still busy: {m}"
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def live():
    server = Subprocess("--speculative-config", SPEC, "--max-model-len", "2048")
    yield server
    server.close()


PROMPTS = [
    "Write a Python function that returns the squares of a list of numbers.",
    "List the days of the week, one per line.",
    "Repeat after me three times: the cat sat on the mat.",
    "What is the capital of France? Answer in one sentence.",
    "Count from 1 to 20 separated by commas.",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give three synonyms for happy.",
    "Write the alphabet in capital letters separated by spaces.",
    "Translate 'good morning' into Spanish, French and German.",
    "Write a JSON object with keys name and age for a person called Ann aged 31.",
    "Write a for loop in C that prints 0 to 9.",
    "Name the planets of the solar system in order.",
    "What is 12 times 12? Show the multiplication.",
    "Write a short limerick about a programmer.",
    "Describe the color blue to someone who cannot see.",
]


def _chat(client, prompt, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, **kw)


def test_chat_and_stream_agree(live):
    c = live.client()
    r = _chat(c, PROMPTS[2], max_tokens=40)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    spec = r.usage.model_extra["speculative"]
    assert spec["steps"] > 0 and spec["draft_tokens"] >= spec["accepted_tokens"]
    chunks = list(_chat(c, PROMPTS[2], max_tokens=40, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_16_parallel_streams_equal_solo_greedy(live):
    c = live.client()
    solo = [_chat(c, p, max_tokens=48).choices[0].message.content for p in PROMPTS]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            stream = _chat(live.client(), PROMPTS[i], max_tokens=48, stream=True)
            results[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len(results) == len(PROMPTS)
    for i, text in enumerate(solo):
        assert results[i] == text, f"prompt {i}: batched output differs from the solo run"


def test_disconnect_frees_kv(live):
    live.wait_idle()
    stream = _chat(live.client(), PROMPTS[4], max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
    for n, _chunk in enumerate(stream):
        if n == 5:
            break
    busy = live.metrics()
    assert busy["vllm:kv_cache_usage_perc"] > 0
    stream.close()
    deadline = time.monotonic() + 30
    while True:
        m = live.metrics()
        if m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"KV not freed after disconnect: {m['vllm:kv_cache_usage_perc']}"
        time.sleep(0.1)


def test_metrics_deltas_equal_usage(live):
    before = live.wait_idle()
    c = live.client()
    usages = [_chat(c, PROMPTS[0], max_tokens=32, n=2).usage,
              c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=24, temperature=0).usage]
    stream = _chat(c, PROMPTS[8], max_tokens=32, stream=True, stream_options={"include_usage": True})
    usages += [ch.usage for ch in stream if ch.usage]
    after = live.wait_idle()
    specs = [u.model_extra["speculative"] for u in usages]
    pairs = {"steps": "vllm:spec_decode_num_drafts_total",
             "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
             "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}
    for field, name in pairs.items():
        assert after[name] - before.get(name, 0) == sum(s[field] for s in specs), name
    for pos in range(4):
        name = f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{pos}]"
        expected = sum(s["accepted_per_pos"][pos] for s in specs if pos < len(s["accepted_per_pos"]))
        assert after.get(name, 0) - before.get(name, 0) == expected, name
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == sum(u.completion_tokens for u in usages)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen_live():
    server = Subprocess("--speculative-config", SPEC, "--max-model-len", "2048", model="qwen2.5-coder-0.5b")
    yield server
    server.close()


def test_tool_calls_with_a_real_model(qwen_live):
    """qwen2.5-coder-0.5b's template offers the tools (auto picks the hermes parser); the model's call
    comes back as tool_calls, streamed and not, with ngram speculation on; the tool's answer goes back
    through the template in a second turn."""
    c = qwen_live.client()
    msgs = [{"role": "user", "content": "What's the weather in Paris right now?"}]
    kw = dict(model="qwen2.5-coder-0.5b", tools=[WEATHER_TOOL], temperature=0, max_tokens=80)
    r = c.chat.completions.create(messages=msgs, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    assert [(t.function.name, json.loads(t.function.arguments)["city"]) for t in msg.tool_calls] == [
        ("get_weather", "Paris")]
    streamed, finish = {}, None
    for ch in c.chat.completions.create(messages=msgs, stream=True, **kw):
        for tc in ch.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, [tc.function.name or "", ""])
            entry[1] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in streamed.values()] == [
        (t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]
    msgs += [msg.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp_c": 14}'}]
    r = c.chat.completions.create(messages=msgs, **kw)
    assert r.choices[0].finish_reason in ("stop", "tool_calls") and (r.choices[0].message.content
                                                                     or r.choices[0].message.tool_calls)
    plain = c.chat.completions.create(messages=msgs[:1], tool_choice="none", **kw).choices[0]
    assert plain.message.tool_calls is None and plain.message.content


def test_infill_with_a_real_model(qwen_live):
    """Code completion at a cursor on qwen2.5-coder-0.5b (ngram speculation on): /infill (llama-server's,
    as llama.vim sends it) and /v1/completions with suffix equal the same fill-in-the-middle prompt
    written out as text, greedy, streamed and not; the model writes the missing expression."""
    http = qwen_live.http
    prefix, suffix = "import math\n\ndef circle_area(r):\n", "\n\n\nprint(circle_area(2.0))\n"
    raw = f"<|fim_prefix|>{prefix}    return <|fim_suffix|>{suffix}<|fim_middle|>"
    want = http.post("/v1/completions", json={"prompt": raw, "max_tokens": 12, "temperature": 0}).json()
    want = want["choices"][0]["text"]
    assert "math.pi" in want
    got = http.post("/v1/completions", json={"prompt": prefix + "    return ", "suffix": suffix, "max_tokens": 12,
                                             "temperature": 0}).json()
    assert got["choices"][0]["text"] == want
    body = {"input_prefix": prefix, "prompt": "    return ", "input_suffix": suffix, "n_predict": 12,
            "temperature": 0, "cache_prompt": True, "samplers": ["top_k", "top_p", "infill"], "t_max_predict_ms": 60000}
    r = http.post("/infill", json=body).json()  # the repository format: <|repo_name|>myproject ... then raw
    assert r["prompt"] == "<|repo_name|>myproject\n<|file_sep|>filename\n" + raw
    want = http.post("/v1/completions", json={"prompt": r["prompt"], "max_tokens": 12, "temperature": 0}).json()
    want = want["choices"][0]["text"]
    assert r["content"] == want and "math.pi" in want and r["stop"] and not r["truncated"]
    assert r["tokens_predicted"] == r["timings"]["predicted_n"] <= 12
    with http.stream("POST", "/infill", json={**body, "stream": True}) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line]
    assert "".join(e["content"] for e in events) == want and [e["stop"] for e in events][-2:] == [False, True]
    r = http.post("/infill", json={**body, "n_predict": 0}).json()  # the prompt alone, into the cache (llama.vim)
    assert r["content"] == "" and r["tokens_predicted"] == 0 and r["stop_type"] == "limit" and r["tokens_evaluated"] > 0
    # n_indent 4: the middle ends before the first later line indented less (the model goes on outside the
    # function); the text is what it wrote up to there, streamed the same
    long = {**body, "n_predict": 40, "n_indent": 4}
    full = http.post("/infill", json={**long, "n_indent": 0}).json()["content"]
    r = http.post("/infill", json=long).json()
    lines = full.split("\n")
    short = next(i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("    "))
    assert r["content"] == "\n".join(lines[:short]) + "\n" and r["stop_type"] == "limit"
    with http.stream("POST", "/infill", json={**long, "stream": True}) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line]
    assert "".join(e["content"] for e in events) == r["content"] and events[-1]["stop_type"] == "limit"
    # t_max_predict_ms (llama.vim sends 500): 1 ms is past after the first token on any machine, so the
    # text ends at the first step that has written a new line
    r = http.post("/infill", json={**long, "n_indent": 0, "t_max_predict_ms": 1}).json()
    assert full.startswith(r["content"]) and "\n" in r["content"] and len(r["content"]) < len(full), r
    assert r["stop_type"] == "limit"
    # a GBNF grammar (llama-server's field) holds the middle to a literal pi where the model writes math.pi
    grammar = {**body, "grammar": 'root ::= "3.14" [0-9]* " * r ** 2"', "n_predict": 16}
    r = http.post("/infill", json=grammar).json()
    assert re.fullmatch(r"3\.14[0-9]* \* r \*\* 2", r["content"]) and r["stop_type"] == "eos", r
    r = http.post("/infill", json={**grammar, "grammar": 'root ::= "unterminated'})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
