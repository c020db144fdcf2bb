"""SIGTERM / SIGINT to a real ``specserve serve`` process (smollm2-135m on loopback) with 4 streams
and 2 non-streaming requests in flight.

Nothing here depends on the machine's speed: the requests are known to be running (each stream
has its first token, the engine counts 6 running) before the signal; they ask for ignore_eos
tokens enough to outlast it; the drain that must let them finish has a timeout far beyond their
length. The only time bound is the issue's: with ``--shutdown-timeout 1`` the process exits within
the timeout plus 5 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 600
WAIT = 600  # the longest any one wait may take on a very busy machine
PROMPTS = ["Write a long story about a lighthouse keeper.", "List every country you know, one per line."]


class Server:
    def __init__(self, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="specserve-drain-", delete=False)
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "specserve", "serve", "--model", MODEL, "--port", str(self.port),
               "--max-model-len", "2048", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert self.proc.poll() is None, f"server exited during start-up:\n{self.output()}"
            assert time.monotonic() < deadline, f"server not ready:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def running(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=WAIT).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running"))

    def signal(self, sig: int = signal.SIGTERM) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture
def start():
    servers = []

    def factory(*flags: str) -> Server:
        servers.append(Server(*flags))
        return servers[-1]

    yield factory
    for s in servers:
        s.close()


class Client(threading.Thread):
    """One greedy completion in a thread: a stream's events (and [DONE]) or the JSON response."""

    def __init__(self, url: str, prompt: str, stream: bool, max_tokens: int):
        super().__init__(daemon=True)
        self.body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": stream}
        if stream:
            self.body["stream_options"] = {"include_usage": True}
        self.url, self.stream = url, stream
        self.events: list[dict] = []
        self.done = False
        self.status: int | None = None
        self.json: dict | None = None
        self.headers: dict = {}
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=WAIT) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                if not self.stream or r.status_code != 200:
                    self.json = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def text(self) -> str:
        if not self.stream:
            return self.json["choices"][0]["text"]
        return "".join(c["text"] for e in self.events for c in e.get("choices", []))

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c["finish_reason"]]


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _load(s: Server, max_tokens: int) -> list[Client]:
    """4 streams and 2 non-streaming requests, all running in the engine."""
    clients = [Client(s.url, PROMPTS[i % 2], True, max_tokens) for i in range(4)]
    clients += [Client(s.url, PROMPTS[i], False, max_tokens) for i in range(2)]
    _until(lambda: all(c.events for c in clients[:4]) and s.running() == 6, "requests not running")
    return clients


def _clean_exit(s: Server, signalled: float, within: float) -> None:
    rc = s.proc.wait(WAIT)
    took = time.monotonic() - signalled
    log = s.output()
    assert rc == 0, f"exit status {rc}:\n{log[-4000:]}"
    assert took <= within, f"exited {took:.1f} s after the signal (bound {within} s)"
    assert "Traceback" not in log and "CancelledError" not in log, log[-4000:]


def test_sigterm_lets_running_requests_finish(start):
    s = start("--shutdown-timeout", "600")
    clients = _load(s, max_tokens=160)
    signalled = s.signal(signal.SIGTERM)
    health = httpx.get(s.url + "/health", timeout=WAIT)
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    refused = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=WAIT)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
    assert refused.json()["error"]["code"] == "server_shutting_down"
    for c in clients:
        c.join(WAIT)
        assert c.error is None and c.status == 200, (c.error, c.status, c.json)
    for c in clients[:4]:
        assert c.done and c.finish_reasons() == ["length"] and c.events[-1]["usage"]["completion_tokens"] == 160
    for c in clients[4:]:
        assert c.json["usage"]["completion_tokens"] == 160 and c.json["choices"][0]["finish_reason"] == "length"
    # greedy and batch-invariant: every request of a prompt has the same full text
    for i in range(2):
        texts = {c.text() for c in clients if c.body["prompt"] == PROMPTS[i]}
        assert len(texts) == 1 and len(next(iter(texts))) > 100
    _clean_exit(s, signalled, within=WAIT)
    assert "draining" in s.output()


def _assert_clean_endings(clients: list[Client]) -> None:
    for c in clients:
        c.join(WAIT)
        assert c.error is None, c.error
        if c.stream:
            assert c.status == 200 and c.done, "a stream must end with data: [DONE]"
            assert c.events[-1]["error"]["code"] == "server_shutting_down" and c.finish_reasons() == []
        else:
            assert c.status == 503 and int(c.headers["retry-after"]) > 0, (c.status, c.json)
            assert c.json["error"]["code"] == "server_shutting_down"


def test_sigterm_with_a_1s_timeout_ends_requests_cleanly(start):
    s = start("--shutdown-timeout", "1")
    clients = _load(s, max_tokens=1800)  # minutes of decoding: still running after 1 s
    signalled = s.signal(signal.SIGTERM)
    _assert_clean_endings(clients)
    _clean_exit(s, signalled, within=1 + 5)


def test_a_second_sigint_ends_requests_at_once(start):
    s = start("--shutdown-timeout", "600")
    clients = _load(s, max_tokens=1800)
    signalled = s.signal(signal.SIGINT)
    _until(lambda: httpx.get(s.url + "/health", timeout=WAIT).status_code == 503, "not draining")
    assert all(c.is_alive() for c in clients)  # the drain lets them run
    s.signal(signal.SIGINT)
    _assert_clean_endings(clients)
    _clean_exit(s, signalled, within=WAIT)


def test_parse_errors_and_latency_histograms_on_the_real_server(start):
    s = start()
    c = Client(s.url, PROMPTS[0], True, 24)
    c.join(WAIT)
    assert c.done and c.events[-1]["usage"]["completion_tokens"] == 24
    metrics = httpx.get(s.url + "/metrics", timeout=WAIT).text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:") and "_count{" in line}
    assert counts["vllm:time_to_first_token_seconds_count"] == counts["vllm:e2e_request_latency_seconds_count"] == 1
    assert counts["vllm:inter_token_latency_seconds_count"] == 24 - 1  # no speculation: one token a step
    with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: twelve\r\n\r\n{}")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["message"] == "invalid HTTP request: bad Content-Length"
    assert httpx.get(s.url + "/health", timeout=WAIT).status_code == 200
    signalled = s.signal(signal.SIGTERM)
    _clean_exit(s, signalled, within=WAIT)
