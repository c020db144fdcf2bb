"""Soak test: one server under a hostile mix of clients for a bounded time (not part of the test suite).

    python benchmarks/soak.py [--minutes 15] [--clients 16] [--model smollm2-135m] [--seed 0]
        [--serve-args "..."] [--out soak.json]

Starts ``specserve serve`` on 127.0.0.1 (a free port), runs every greedy request of a fixed set alone
(the references), then --clients threads for --minutes minutes, each picking at random: a greedy
request of the set (chat or completions, streamed or not, n = 1 or 2, stop strings, a ~1,500-token
prompt), a stream it drops after a few chunks, a sampled request with n = 2, a prompt longer than
the context, or a malformed request (bad JSON, wrong types, bad values, an unknown model, a body
over the size limit, a non-numeric Content-Length on a raw socket). Then it stops issuing, waits for
the engine to go idle and stops the server (SIGINT: the graceful drain).

Reported, and checked (exit status 1 if one fails): no 5xx; every completed greedy output equal
to its solo run, choice for choice; malformed and over-long requests answered with a 4xx JSON
error; the KV cache back to 0 blocks in use; the server's RSS grown by less than 5% from after the
warm-up to the end; no traceback in the server's output; exit status 0 after the drain.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time
from collections import Counter

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specserve.bench.serverproc import ManagedServer, free_port, serve_argv  # noqa: E402

MAX_LEN = 2048
DOC = " ".join(f"Section {i}: the harbour office logged {i * 7 % 31} ships, {i * 3 % 11} storms and "
               f"{i * 5 % 17} repairs." for i in range(90))  # about 1,500 tokens
OVER_LONG = "word " * (MAX_LEN + 200)

# greedy requests whose output is compared with their solo run: (endpoint, body)
GREEDY = [
    ("chat", {"messages": [{"role": "user", "content": "List the days of the week, one per line."}],
              "max_tokens": 48}),
    ("chat", {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 40,
              "stop": ["\n\n"]}),
    ("chat", {"messages": [{"role": "user", "content": "Count from 1 to 30 separated by commas."}],
              "max_tokens": 64, "stop": [", 17"], "n": 2}),
    ("chat", {"messages": [{"role": "user", "content": "Explain what a hash table is."}], "max_tokens": 56,
              "n": 2}),
    ("completions", {"prompt": "def fibonacci(n):\n", "max_tokens": 48, "stop": ["\ndef "]}),
    ("completions", {"prompt": "The capital of France is", "max_tokens": 24, "n": 2}),
    ("completions", {"prompt": DOC + "\nQuestion: how many ships were logged in Section 12?\nAnswer:",
                     "max_tokens": 16}),
    ("chat", {"messages": [{"role": "system", "content": DOC},
                           {"role": "user", "content": "Summarize section 3 in one sentence."}], "max_tokens": 32}),
]


def endpoint_path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def choice_texts(kind: str, obj: dict) -> list[str]:
    key = (lambda c: c["message"]["content"]) if kind == "chat" else (lambda c: c["text"])
    return [key(c) for c in sorted(obj["choices"], key=lambda c: c["index"])]


class Tally:
    """Counts shared by the client threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.problems: list[str] = []

    def add(self, key: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if problem and len(self.problems) < 50:
                self.problems.append(problem)


def run_greedy(client: httpx.Client, kind: str, body: dict, stream: bool) -> tuple[int, list[str] | None]:
    """(status, texts per choice) of one greedy request, streamed or not."""
    body = {**body, "temperature": 0, "stream": stream}
    if not stream:
        r = client.post(endpoint_path(kind), json=body)
        return r.status_code, choice_texts(kind, r.json()) if r.status_code == 200 else None
    texts: dict[int, str] = {}
    with client.stream("POST", endpoint_path(kind), json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return 599, None  # an error event in a stream: counted as a server failure
            for c in obj["choices"]:
                piece = c["delta"].get("content") if kind == "chat" else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return 200, [texts[i] for i in sorted(texts)]


MALFORMED = [
    ("raw", b"{not json"), ("json", {"messages": "hi"}), ("json", {}),
    ("json", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}),
    ("json", {"messages": [{"role": "user", "content": "x"}], "n": 1000}),
    ("json", {"prompt": "x", "temperature": "hot"}), ("json", {"prompt": "x", "model": "no-such-model"}),
    ("json", {"prompt": [10**12]}), ("json", {"prompt": "x", "logit_bias": {"abc": 5}}),
    ("big", None), ("socket", None),
]


def malformed(client: httpx.Client, url: str, rnd: random.Random, tally: Tally) -> None:
    how, body = rnd.choice(MALFORMED)
    path = rnd.choice(["/v1/chat/completions", "/v1/completions"])
    if how == "socket":
        status, payload = raw_bad_content_length(url)
    else:
        if how == "raw":
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        elif how == "big":
            r = client.post(path, content=b'{"prompt": "' + b"x" * 300_000 + b'"}')
        else:
            r = client.post(path, json=body)
        status, payload = r.status_code, r.content
    try:
        ok = 400 <= status < 500 and "error" in json.loads(payload)
    except ValueError:
        ok = False
    tally.add(f"malformed {status}", None if ok else f"malformed {how} {body!r:.60}: {status} {payload[:120]!r}")
    if status >= 500:
        tally.add("5xx", f"malformed {how}: {status}")


def raw_bad_content_length(url: str) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n{}")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def one_action(client: httpx.Client, url: str, rnd: random.Random, refs: list, tally: Tally) -> None:
    roll = rnd.random()
    if roll < 0.45:
        i = rnd.randrange(len(GREEDY))
        kind, body = GREEDY[i]
        status, texts = run_greedy(client, kind, body, stream=rnd.random() < 0.6)
        tally.add(f"greedy {status}")
        if status >= 500:
            tally.add("5xx", f"greedy {i}: {status}")
        elif status == 200:
            same = texts == refs[i]
            tally.add("greedy compared" if same else "greedy MISMATCH",
                      None if same else f"greedy {i}: {texts!r:.200} != {refs[i]!r:.200}")
    elif roll < 0.65:  # a stream dropped after a few chunks
        body = {"prompt": rnd.choice(["Once upon a time", "The history of ships", DOC[:2000]]), "max_tokens": 400,
                "ignore_eos": True, "stream": True, "temperature": rnd.choice([0, 0.7])}
        keep = rnd.randint(1, 40)
        with client.stream("POST", "/v1/completions", json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= keep:
                    break
        tally.add("disconnect")
    elif roll < 0.78:  # sampled, n = 2, with a stop string
        body = {"messages": [{"role": "user", "content": "Tell me a fact about the moon."}], "n": 2,
                "max_tokens": rnd.randint(8, 64), "temperature": 0.9, "seed": rnd.randrange(1000),
                "stop": ["."], "stream": rnd.random() < 0.5}
        status, _ = _sampled(client, body)
        tally.add(f"sampled {status}")
        if status >= 500:
            tally.add("5xx", f"sampled: {status}")
    elif roll < 0.86:  # longer than the context
        r = client.post("/v1/completions", json={"prompt": OVER_LONG, "max_tokens": 8})
        ok = r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        tally.add(f"over-long {r.status_code}", None if ok else f"over-long: {r.status_code} {r.text[:120]}")
        if r.status_code >= 500:
            tally.add("5xx", "over-long")
    else:
        malformed(client, url, rnd, tally)


def _sampled(client: httpx.Client, body: dict) -> tuple[int, None]:
    if not body["stream"]:
        return client.post("/v1/chat/completions", json=body).status_code, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        bad = any(line.startswith("data: {") and '"error"' in line[:20] for line in r.iter_lines())
        return (599 if bad else r.status_code), None


def worker(url: str, seed: int, until: float, refs: list, tally: Tally) -> None:
    rnd = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as client:
        while time.monotonic() < until:
            try:
                one_action(client, url, rnd, refs, tally)
            except httpx.TimeoutException:
                tally.add("client timeout", "a request took more than 600 s")
            except httpx.HTTPError as exc:
                tally.add("transport error", f"{type(exc).__name__}: {exc}")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


class SoakServer(ManagedServer):
    """ManagedServer that also counts tracebacks in everything the server prints."""

    tracebacks = 0

    def _drain(self, stream) -> None:
        for line in stream:
            if "Traceback" in line:
                self.tracebacks += 1
            self.tail.append(line.rstrip("\n"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra flags for specserve serve")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    port = free_port()
    flags = (f"--model {a.model} --max-model-len {MAX_LEN} --max-request-bytes 262144 --shutdown-timeout 60 "
             f"{a.serve_args}")
    server = SoakServer(serve_argv(flags, port), port, "soak").start()
    url = server.url
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            refs = [run_greedy(client, kind, body, stream=False)[1] for kind, body in GREEDY]  # solo, one at a time
        warm = Tally()  # a short burst of the same mix: the allocator's high-water mark before the baseline
        threads = [threading.Thread(target=worker, args=(url, 10_000 + i, time.monotonic() + 20, refs, warm))
                   for i in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        idle_kv(url, 120)
        rss0, tally, t0 = rss_bytes(server.proc.pid), Tally(), time.monotonic()
        until = t0 + 60 * a.minutes
        threads = [threading.Thread(target=worker, args=(url, a.seed * 1000 + i, until, refs, tally))
                   for i in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0  # the requests in flight at the deadline still finish
        kv = idle_kv(url, 120)
        rss1 = rss_bytes(server.proc.pid)
        healthy = httpx.get(url + "/health", timeout=60).status_code == 200
    finally:
        status = server.stop()
    growth = (rss1 - rss0) / rss0
    report = {"minutes_issuing": a.minutes, "minutes_until_all_done": round(elapsed / 60, 2), "clients": a.clients, "counts": dict(sorted(tally.counts.items())),
              "five_xx": tally.counts["5xx"], "greedy_compared": tally.counts["greedy compared"],
              "greedy_mismatches": tally.counts["greedy MISMATCH"], "kv_usage_after": kv,
              "rss_start_mib": round(rss0 / 2**20, 1), "rss_end_mib": round(rss1 / 2**20, 1),
              "rss_growth_pct": round(100 * growth, 2), "healthy_after": healthy,
              "server_tracebacks": server.tracebacks, "exit_status": status,
              "warm_up_counts": dict(sorted(warm.counts.items())), "problems": tally.problems + warm.problems}
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    bad_4xx = [p for p in tally.problems if p.startswith(("malformed", "over-long"))]
    ok = (report["five_xx"] == 0 and report["greedy_mismatches"] == 0 and kv == 0 and growth < 0.05 and healthy
          and server.tracebacks == 0 and status == 0 and not bad_4xx and report["greedy_compared"] > 0)
    print("soak: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def idle_kv(url: str, timeout: float) -> float:
    """Wait until nothing runs or waits and the KV cache is empty; returns the usage seen last."""
    deadline = time.monotonic() + timeout
    while True:
        busy = metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")
        kv = metric(url, "vllm:kv_cache_usage_perc")
        if (busy == 0 and kv == 0) or time.monotonic() > deadline:
            return kv
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
