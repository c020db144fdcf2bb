"""The shutdown drain and the HTTP parser's JSON errors, over real HTTP against a FakeEngine.

The server is built as ``specserve serve`` builds it (create_app with a Drain, uvicorn_config);
``Drain.request()`` is what its signal handler calls. The FakeEngine's gate holds every request
after its first output, so "in flight when the signal arrives" does not depend on timing.
A real ``specserve serve`` process gets SIGTERM in tests/test_drain_live.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from fake_engine import FakeEngine
from specserve.server.app import create_app
from specserve.server.config import ServerConfig
from specserve.server.drain import RETRY_AFTER_S, Drain
from specserve.server.http_protocol import uvicorn_config

MSGS = [{"role": "user", "content": "hi"}]
WAIT = 60  # generous: nothing here waits on the machine's speed, only on events


class DrainServer:
    def __init__(self, timeout_s: float, engine: FakeEngine | None = None):
        self.engine = engine or FakeEngine()
        self.engine.gate = threading.Event()
        self.drain = Drain(timeout_s, self.engine.fail_all, self._stop)
        self.app = create_app(self.engine, ServerConfig(), self.drain)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", 0, "warning", 1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        _until(lambda: self.server.started, "uvicorn did not start")
        self.forced = []

    def _stop(self, force: bool) -> None:
        self.forced.append(force)
        self.server.should_exit = True

    def close(self) -> None:
        self.engine.gate.set()
        self.server.should_exit = True
        self.thread.join(WAIT)


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def make():
    servers = []

    def factory(timeout_s: float) -> DrainServer:
        servers.append(DrainServer(timeout_s))
        return servers[-1]

    yield factory
    for s in servers:
        s.close()


class Client(threading.Thread):
    """One request in a thread: a stream's events (and whether it saw [DONE]) or a JSON response."""

    def __init__(self, url: str, stream: bool, max_tokens: int = 40):
        super().__init__(daemon=True)
        self.url, self.stream, self.max_tokens = url, stream, max_tokens
        self.events: list[dict] = []
        self.done = False
        self.status: int | None = None
        self.body: dict | None = None
        self.headers: dict = {}
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        body = {"messages": MSGS, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": self.stream,
                "stream_options": {"include_usage": True} if self.stream else None}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=WAIT) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                if not self.stream or r.status_code != 200:
                    self.body = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc

    def text(self) -> str:
        return "".join(c["delta"].get("content") or "" for e in self.events for c in e.get("choices", []))


def _in_flight(s: DrainServer, n: int, clients: list[Client]) -> None:
    _until(lambda: len(s.engine.engine.running) == n and all(c.events for c in clients if c.stream),
           "requests not running")


def test_drain_lets_running_requests_finish_and_refuses_new_ones(make):
    s = make(timeout_s=600)
    clients = [Client(s.url, stream=True) for _ in range(3)] + [Client(s.url, stream=False)]
    _in_flight(s, 4, clients)
    s.drain.request()
    _until(lambda: s.drain.draining, "drain did not begin")
    for probe in ("/health", "/v1/health"):
        health = httpx.get(s.url + probe, timeout=WAIT)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
    refused = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSGS}, timeout=WAIT)
    assert refused.status_code == 503 and refused.headers["retry-after"] == str(RETRY_AFTER_S)
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert httpx.get(s.url + "/metrics", timeout=WAIT).status_code == 200  # scrapers still answered
    assert s.thread.is_alive()  # still serving the requests in flight
    s.engine.gate.set()
    for c in clients:
        c.join(WAIT)
        assert c.error is None and c.status == 200
    for c in clients[:3]:
        assert c.done and c.events[-1]["usage"]["completion_tokens"] == 40
        assert [ch["finish_reason"] for e in c.events for ch in e.get("choices", []) if ch["finish_reason"]] == [
            "length"]
    assert clients[3].body["usage"]["completion_tokens"] == 40
    assert clients[3].body["choices"][0]["finish_reason"] == "length"
    s.thread.join(WAIT)
    assert not s.thread.is_alive() and s.forced == [False]


def _assert_clean_endings(clients: list[Client]) -> None:
    for c in clients:
        c.join(WAIT)
        assert c.error is None, c.error
        if c.stream:
            assert c.status == 200 and c.done, "a stream must end with [DONE]"
            assert c.events[-1]["error"]["code"] == "server_shutting_down"
        else:
            assert c.status == 503 and c.headers["retry-after"] == str(RETRY_AFTER_S)
            assert c.body["error"]["type"] == "server_error" and c.body["error"]["code"] == "server_shutting_down"


def test_drain_timeout_ends_the_rest_with_clean_errors(make):
    s = make(timeout_s=0.5)
    clients = [Client(s.url, stream=True) for _ in range(2)] + [Client(s.url, stream=False) for _ in range(2)]
    _in_flight(s, 4, clients)
    s.drain.request()  # the gate stays shut: nothing can finish within the timeout
    _assert_clean_endings(clients)
    s.thread.join(WAIT)
    assert not s.thread.is_alive() and s.forced == [False]


def test_a_second_signal_ends_the_requests_at_once(make):
    s = make(timeout_s=600)
    clients = [Client(s.url, stream=True), Client(s.url, stream=False)]
    _in_flight(s, 2, clients)
    s.drain.request()
    _until(lambda: s.drain.draining, "drain did not begin")
    assert s.engine.failed_with is None
    s.drain.request()
    _assert_clean_endings(clients)
    s.thread.join(WAIT)
    assert not s.thread.is_alive()


def test_an_idle_server_drains_at_once(make):
    s = make(timeout_s=600)
    s.drain.request()
    s.thread.join(WAIT)
    assert not s.thread.is_alive() and s.forced == [False] and s.engine.failed_with is None


# ---------------------------------------------------------------- the HTTP parser's errors

def _raw(url: str, data: bytes) -> tuple[int, dict, bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("request_bytes,status,reason", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", 400, "Content-Length"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400, ""),
    (b"NOT A REQUEST LINE\r\n\r\n", 400, ""),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n", 400, ""),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000, 431, "too long"),  # never ends
], ids=["content-length-not-a-number", "two-content-lengths", "request-line", "header-line", "headers-too-big"])
def test_requests_the_http_parser_refuses_get_json_errors(make, request_bytes, status, reason):
    s = make(timeout_s=1)
    got, headers, body = _raw(s.url, request_bytes)
    assert got == status and headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_http_request"
    assert err["message"].startswith("invalid HTTP request") and reason in err["message"]
    assert httpx.get(s.url + "/health", timeout=WAIT).json() == {"status": "ok"}  # still serving


def test_a_header_block_over_16_kb_that_arrives_whole_is_431(make):
    """h11 limits a header block only while it is incomplete: one sent whole (here 20 KB, in one
    write) got a 200. The middleware counts the parsed block."""
    s = make(timeout_s=1)
    got, headers, body = _raw(s.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
                              + b"a" * 20000 + b"\r\n\r\n")
    assert got == 431 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    ok, _, _ = _raw(s.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
                    + b"a" * 8000 + b"\r\n\r\n")
    assert ok == 200
