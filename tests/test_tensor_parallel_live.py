"""``specserve serve -tp 2`` as users run it: a real model (qwen2.5-coder-0.5b, its GGUF blocks
split over two worker processes), real HTTP, and a rank killed in the middle of a stream.

No timing assertion but the issue's: once a rank dies the server exits non-zero within 30 s of
it (the collectives' timeout, --dist-timeout 20 here, bounds every wait)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from specserve.bench.serverproc import ManagedServer, free_port, serve_argv

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b"
ARGS = f"--model {MODEL} -tp 2 --max-model-len 1024 --kv-cache-memory 96MiB --dist-timeout 20"


def chat(url: str, text: str, **kw) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 24, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture(scope="module")
def plain_text():
    """What one rank answers (the comparison for greedy text)."""
    port = free_port()
    with ManagedServer(serve_argv(f"--model {MODEL} --max-model-len 1024 --kv-cache-memory 96MiB", port),
                       port, "tp1") as s:
        return chat(s.url, "Write a python function that reverses a string.")["choices"][0]["message"]["content"]


def test_serve_tp2_answers_like_one_rank_and_speculation_keeps_its_text(plain_text):
    port = free_port()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    with ManagedServer(serve_argv(f"{ARGS} --speculative-config '{spec}'", port), port, "tp2") as s:
        assert len(children(s.proc.pid)) == 1  # rank 1: a worker process of the server's own
        text = chat(s.url, "Write a python function that reverses a string.")["choices"][0]["message"]["content"]
        assert text[:40] == plain_text[:40]
        assert httpx.get(s.url + "/health", timeout=10).json() == {"status": "ok"}
        assert s.stop() == 0
    assert "exited with code" not in s.last_lines(40)  # a clean stop is not a rank failure


def test_a_killed_rank_fails_the_stream_and_the_server_exits_within_30s():
    port = free_port()
    s = ManagedServer(serve_argv(ARGS, port), port, "tp2-kill").start()
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 500."}],
                "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # the stream is running
            assert "error" not in first
            worker = children(s.proc.pid)[0]
            killed_at = time.monotonic()
            os.kill(worker, signal.SIGKILL)
            rest = "\n".join(lines)
        assert '"error"' in rest and "rank 1" in rest, rest[-500:]  # an error event naming the rank
        code = s.proc.wait(30)
        assert time.monotonic() - killed_at < 30
        assert code != 0
    finally:
        s.stop()
