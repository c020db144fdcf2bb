"""A fake OpenAI-compatible server for the bench tests, run in a thread: each request advances a
virtual clock by a known amount (the bench client reads that clock, so rates, medians and ratios
are exact), with knobs for answers, delays, failures, /tokenize and the speculative counters it
reports (vLLM's or llama.cpp's metric family, usage.speculative, llama.cpp's timings)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

SPEC = {"steps": 2, "draft_tokens": 8, "accepted_tokens": 5, "mean_acceptance_length": 3.5}


class VClock:
    """A clock only the fake server moves."""

    def __init__(self) -> None:
        self.t = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        with self.lock:
            self.t += dt


class Fake:
    """Knobs and state of one fake server."""

    def __init__(self, clock: VClock, prefix: str = "vllm"):
        self.clock = clock
        self.prefix = prefix              # metric family; None: /metrics answers 404
        self.answer: Callable[[str, int], str] = lambda content, n: f"echo {content}"
        self.delay: Callable[[str], float] = lambda content: 0.5   # virtual seconds
        self.real_sleep: dict[str, float] = {}                     # substring -> seconds
        self.fail: set[str] = set()                                # substring -> HTTP 500
        self.tokenize = True
        self.spec = dict(SPEC)                                     # what each request drafts
        self.usage_spec = True                                     # report it in usage.speculative
        self.timings = False                                       # report it in llama.cpp timings
        self.skew = 0                                              # extra /metrics drafts per request
        self.counters = {"draft_tokens": 0, "accepted_tokens": 0, "drafts": 0}
        self.calls: list[str] = []
        self.seen_systems: set[str] = set()
        self.lock = threading.Lock()

    def metrics_text(self) -> str:
        p, c = self.prefix, self.counters
        lines = []
        names = (("draft_tokens", "num_draft_tokens"), ("accepted_tokens", "num_accepted_tokens"),
                 ("drafts", "num_drafts"))
        for key, name in names:
            lines += [f"# TYPE {p}:spec_decode_{name} counter",
                      f'{p}:spec_decode_{name}_total{{model_name="x"}} {c[key]}']
        return "\n".join(["# TYPE other_total counter", "other_total 3", *lines]) + "\n"


def _content(body: dict[str, Any]) -> tuple[str, str]:
    msgs = body.get("messages") or [{"role": "user", "content": body.get("prompt", "")}]
    system = "".join(m["content"] for m in msgs if m["role"] == "system")
    return msgs[-1]["content"], system


def make_handler(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def send(self, code: int, obj: Any, ctype: str = "application/json") -> None:
            data = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self.send(200, {"data": [{"id": "fake-model", "max_model_len": 4096}]})
            elif self.path == "/health":
                self.send(200, {"status": "ok"})
            elif self.path == "/version":
                self.send(200, {"version": "fake-1"})
            elif self.path == "/metrics" and fake.prefix:
                self.send(200, fake.metrics_text(), "text/plain")
            else:
                self.send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                if not fake.tokenize:
                    return self.send(404, {"error": "no"})
                words = body["prompt"].split(" ")
                return self.send(200, {"tokens": [abs(hash(w)) % 50000 for w in words]})
            content, system = _content(body)
            for key, secs in fake.real_sleep.items():
                if key in content:
                    time.sleep(secs)
            with fake.lock:
                fake.calls.append(content)
                n = sum(1 for c in fake.calls if c == content)
            if any(key in content for key in fake.fail):
                return self.send(500, {"error": "boom"})
            text = fake.answer(content, n)
            usage = self.usage(body, text, system)
            if body.get("stream"):
                return self.stream(text, usage, system)
            fake.clock.advance(fake.delay(content))
            key = "message" if "messages" in body else "text"
            choice = {"index": 0, "finish_reason": "length",
                      key: {"role": "assistant", "content": text} if key == "message" else text}
            out = {"choices": [choice], "usage": usage}
            if fake.timings:
                out["timings"] = {"draft_n": fake.spec["draft_tokens"],
                                  "draft_n_accepted": fake.spec["accepted_tokens"]}
            self.send(200, out)

        def usage(self, body: dict[str, Any], text: str, system: str) -> dict[str, Any]:
            prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt"))) // 4
            cached = prompt_tokens - 10 if system and system in fake.seen_systems else 0
            fake.seen_systems.add(system)
            with fake.lock:
                fake.counters["draft_tokens"] += fake.spec["draft_tokens"] + fake.skew
                fake.counters["accepted_tokens"] += fake.spec["accepted_tokens"]
                fake.counters["drafts"] += fake.spec["steps"]
            return {"prompt_tokens": prompt_tokens, "completion_tokens": len(text.split(" ")),
                    "total_tokens": 0, "prompt_tokens_details": {"cached_tokens": cached},
                    "speculative": dict(fake.spec) if fake.usage_spec else None}

        def stream(self, text: str, usage: dict[str, Any], system: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            # prefill: 1 ms per uncached prompt token (virtual)
            uncached = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
            fake.clock.advance(uncached / 1000)
            for i, word in enumerate(text.split(" ")):
                delta = {"content": word if i == 0 else " " + word}
                chunk = {"choices": [{"index": 0, "delta": delta}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()  # no virtual time after the first chunk: TTFT is exact
            final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
            self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())

    return Handler


class Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the client hung up (timeout test)
