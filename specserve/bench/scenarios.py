"""Scenarios beyond the prompt suites: shared-prefix caching, needle in a haystack, concurrency."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from specserve.bench.analysis import spread
from specserve.bench.client import BenchClient, RequestResult, build_request, read_response, transport_error
from specserve.bench.documents import insert_at, take
from specserve.bench.suites import Prompt

QUESTIONS = (
    "In one sentence, what is the main argument of the first essay?",
    "Name two people mentioned in the document.",
    "Quote the shortest sentence you can find in the document.",
    "Which topic comes up most often in the document?",
    "Give a three-word title for the document.",
    "Does the author sound optimistic or pessimistic? Answer in one word.",
    "What year is mentioned first in the document?",
    "List three nouns that appear in the last paragraph.",
)
WORDS = ("AMBER", "BASALT", "CEDAR", "DELTA", "EMBER", "FJORD", "GRANITE", "HARBOR", "INDIGO")


@dataclass
class TtftOptions:
    """How to measure time to first token: a stream's first content chunk, or max_tokens=1."""

    method: str = "stream"
    answer_tokens: int = 32


def measure(client: BenchClient, prompt: Prompt, res: RequestResult, opts: TtftOptions) -> RequestResult:
    """One TTFT measurement; with ``max1`` the TTFT is the wall time of a 1-token request."""
    if opts.method == "max1":
        client.complete(prompt, 1, res)
        res.ttft_s = res.wall_s if res.ok else None
        return res
    return client.stream(prompt, opts.answer_tokens, res)


def chars_per_token(client: BenchClient, text: str) -> float:
    """Characters per token of this server's tokenizer on ``text`` (4.0 if it cannot tell)."""
    sample = text[:4000]
    tokens = client.tokenize(sample)
    return len(sample) / len(tokens) if tokens else 4.0


def _row(res: RequestResult, **extra: Any) -> dict[str, Any]:
    keys = ("ok", "error", "ttft_s", "wall_s", "prompt_tokens", "cached_tokens",
            "completion_tokens", "finish_reason", "sha256")
    return {**extra, **{k: getattr(res, k) for k in keys}}


def prefix(client: BenchClient, label: str, document: str, prefix_tokens: int = 4096,
           rounds: int = 4, opts: TtftOptions | None = None) -> dict[str, Any]:
    """A long shared prefix then ``rounds`` different short questions: cold vs warm TTFT."""
    opts = opts or TtftOptions()
    cpt = chars_per_token(client, document)
    doc = take(document, int(prefix_tokens * cpt))
    nonce = uuid.uuid4().hex[:12]  # a fresh prefix, so the first request is really cold
    system = (f"Session {nonce}. Answer questions about the document below briefly.\n\n"
              f"<document>\n{doc}\n</document>")
    rows = []
    for i in range(rounds):
        prompt = Prompt(f"prefix-{i}", "prefix", [{"role": "system", "content": system},
                                                  {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        res = measure(client, prompt, RequestResult(label, "prefix", prompt.id, run=i), opts)
        rows.append(_row(res, round=i, cold=i == 0))
    cold = rows[0]["ttft_s"] if rows and rows[0]["ok"] else None
    warm = spread(r["ttft_s"] for r in rows[1:] if r["ok"])
    cached = [r["cached_tokens"] for r in rows[1:] if r["ok"] and r["cached_tokens"] is not None]
    return {"label": label, "prefix_tokens_target": prefix_tokens, "rounds": rounds,
            "ttft_method": opts.method, "cold_ttft_s": cold, "warm_ttft_s": warm,
            "cold_over_warm": cold / warm["median"] if cold and warm and warm["median"] else None,
            "prompt_tokens": rows[0]["prompt_tokens"] if rows else None,
            "warm_cached_tokens": statistics.median(cached) if cached else None,
            "cached_tokens_reported": bool(cached), "rows": rows}


def default_lengths(context_max: int, fraction: float = 0.75) -> list[int]:
    """1024, 2048, ... up to ``fraction`` of the context (at least one length)."""
    top = int(context_max * fraction)
    lengths, n = [], 1024
    while n <= top:
        lengths.append(n)
        n *= 2
    return lengths or [max(top, 64)]


def needle(client: BenchClient, label: str, document: str, lengths: list[int],
           depth: float = 0.5, opts: TtftOptions | None = None) -> dict[str, Any]:
    """A secret code buried at ``depth`` of documents of several token lengths."""
    opts = opts or TtftOptions(answer_tokens=32)
    cpt = chars_per_token(client, document)
    rows = []
    for length in lengths:
        rng = random.Random(length)
        code = f"{rng.choice(WORDS)}-{rng.randint(1000, 9999)}"
        sentence = f"The vault passphrase for the east archive is {code}."
        question = "What is the vault passphrase for the east archive? Reply with the passphrase only."
        body = insert_at(take(document, max(int((length - 60) * cpt), 200)), sentence, depth)
        prompt = Prompt(f"needle-{length}", "needle",
                        [{"role": "user", "content": f"<document>\n{body}\n</document>\n\n{question}"}])
        res = measure(client, prompt, RequestResult(label, "needle", prompt.id), opts)
        found = res.ok and code.lower() in (res.text or "").lower()
        prefill = (res.prompt_tokens / res.ttft_s) if res.ok and res.prompt_tokens and res.ttft_s else None
        rows.append(_row(res, target_tokens=length, depth=depth, code=code, found=found,
                         prefill_tok_s=prefill, answer=(res.text or "")[:120]))
        if res.ok and res.prompt_tokens:
            cpt = len(prompt.as_text()) / res.prompt_tokens  # calibrate on the real count
    return {"label": label, "depth": depth, "ttft_method": opts.method, "rows": rows,
            "found": sum(1 for r in rows if r["found"]), "lengths": len(rows)}


async def _one(http: httpx.AsyncClient, client: BenchClient, prompt: Prompt, max_tokens: int,
               res: RequestResult) -> RequestResult:
    path, body = build_request(client.endpoint, client.resolve_model(), prompt, max_tokens)
    t0 = time.perf_counter()
    try:
        resp = await http.post(path, json=body)
    except httpx.HTTPError as exc:
        res.error, res.wall_s = transport_error(exc, client.timeout), time.perf_counter() - t0
        return res
    return read_response(res, resp, client.endpoint, time.perf_counter() - t0)


async def _level(client: BenchClient, label: str, prompts: list[Prompt], clients: int,
                 per_client: int, max_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(base_url=client.root, headers=client.headers,
                                 timeout=client.timeout, limits=limits) as http:
        async def worker(w: int) -> list[RequestResult]:
            out = []
            for k in range(per_client):
                p = prompts[(w * per_client + k) % len(prompts)]
                res = RequestResult(label, f"concurrency-{clients}", p.id, run=k, extra={"client": w})
                out.append(await _one(http, client, p, max_tokens, res))
            return out

        t0 = time.perf_counter()
        done = await asyncio.gather(*(worker(w) for w in range(clients)))
        wall = time.perf_counter() - t0
    results = [r for batch in done for r in batch]
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {"concurrency": clients, "requests": len(results), "ok": len(ok),
            "errors": [r.error for r in results if not r.ok], "wall_s": wall,
            "completion_tokens": tokens, "aggregate_tok_s": tokens / wall if wall > 0 else None,
            "per_request_tok_s": spread(r.tok_s for r in ok),
            "raw": [r.to_dict() | {"text": None} for r in results]}


def concurrency(client: BenchClient, label: str, prompts: list[Prompt], levels: list[int],
                per_client: int = 2, max_tokens: int = 512) -> dict[str, Any]:
    """Aggregate and per-request tok/s with 1, 2, 4, ... clients sending at once."""
    client.resolve_model()
    rows = [asyncio.run(_level(client, label, prompts, c, per_client, max_tokens)) for c in levels]
    return {"label": label, "requests_per_client": per_client, "max_tokens": max_tokens,
            "levels": rows}
