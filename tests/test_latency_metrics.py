"""vLLM's latency histograms on /metrics: time to first token, inter-token latency, end-to-end
latency, per request (one choice = one engine request), over real HTTP against a FakeEngine."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import FakeEngine
from specserve.server.app import create_app
from specserve.server.config import ServerConfig

HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds")


def _serve(engine: FakeEngine):
    app = create_app(engine, ServerConfig())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def histograms(text: str) -> dict[str, dict]:
    """name -> {"count", "sum", "buckets": [(le, cumulative count)]} for the three histograms."""
    out = {name: {"buckets": []} for name in HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for name in HISTOGRAMS:
                if s.name == name + "_count":
                    out[name]["count"] = s.value
                elif s.name == name + "_sum":
                    out[name]["sum"] = s.value
                elif s.name == name + "_bucket":
                    out[name]["buckets"].append((float(s.labels["le"]), s.value))
    return out


def test_latency_histograms_count_requests_and_tokens():
    engine = FakeEngine(spec=False, step_delay=0.005)  # one token per output
    server, thread, url = _serve(engine)
    try:
        before = histograms(httpx.get(url + "/metrics").text)
        assert all(before[n]["count"] == 0 for n in HISTOGRAMS)  # exported before the first request
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "ignore_eos": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 12, "ignore_eos": True, "stream": True, "n": 2}) as s:
            assert sum(line.startswith("data: {") for line in s.iter_lines()) == 24
        h = histograms(httpx.get(url + "/metrics").text)
    finally:
        server.should_exit = True
        thread.join(30)
    assert r["usage"]["completion_tokens"] == 20
    assert h["vllm:time_to_first_token_seconds"]["count"] == 3  # one per choice
    assert h["vllm:e2e_request_latency_seconds"]["count"] == 3
    assert h["vllm:inter_token_latency_seconds"]["count"] == (20 - 1) + 2 * (12 - 1)  # every later token
    for name in HISTOGRAMS:
        buckets = h[name]["buckets"]
        assert buckets[-1] == (float("inf"), h[name]["count"])
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))  # cumulative
    # every token after the first came at least one 5 ms step later; a request lasts longer than its first token
    assert h["vllm:inter_token_latency_seconds"]["sum"] >= 0.005 * 41 * 0.5
    assert h["vllm:e2e_request_latency_seconds"]["sum"] > h["vllm:time_to_first_token_seconds"]["sum"]
