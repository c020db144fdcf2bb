"""Running streams' inter-token latency while long prompts arrive: fixed prefill chunks vs the step budget.

    python benchmarks/prefill_stall.py [--model smollm2-135m] [--streams 4] [--prompt-tokens 4096,8000]
        [--stream-tokens 3000] [--tail 2] [--config "off=--max-step-ms 0" --config "on="]
        [--out out.json] [--markdown out.md]

One ``specserve serve`` per --config (NAME=SERVE_FLAGS), started one after the other on loopback,
each alone on the machine. Against each: --streams greedy streams decode (ignore_eos); once every
stream has tokens, a prompt of each --prompt-tokens size arrives in turn (the next after the last
one's first token). Every gap between two tokens of a stream is timed on the client; the gaps that
end while a long prompt is prefilled (from its arrival to its first token) are its stall. Reported
per config and prompt: the streams' p50 / p99 / longest gap during that prefill, how many tokens they
got meanwhile, and the prompt's time to first token; and whether every output is identical across
the configs (chunking must never change them): each long prompt's answer, and each stream's text
as far as its shortest run got (the streams ask for more tokens than a run needs and are dropped
--tail seconds after the last prompt's first token). Exit status 1 if not, or if a stream ended
before the last prompt's first token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specserve.bench.serverproc import ManagedServer, free_port, serve_argv  # noqa: E402

WORDS = ("harbour ledger clerk bridge council tide lantern archive copper signal route ferry warden "
         "granite orchard census beacon timber mill quarry vessel charter market furnace canal").split()
STREAM_PROMPTS = ["Write a long story about a lighthouse keeper and the sea.",
                  "Describe, step by step, how a city water system works.",
                  "Tell the history of a small mountain village over three centuries.",
                  "Explain in detail how to plan and plant a vegetable garden."]


def long_text(seed: int, words: int) -> str:
    rnd = random.Random(seed)
    lines = []
    for i in range(words // 12 + 1):
        lines.append(f"Entry {seed}-{i}: " + " ".join(rnd.choice(WORDS) for _ in range(12)) + ".")
    return "\n".join(lines)


class Stream(threading.Thread):
    """One greedy streaming completion; keeps (arrival time, text) of every event. ``stop`` set:
    the client goes away (the server aborts the stream)."""

    def __init__(self, url: str, model: str, prompt, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.body = url, {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True, "stream": True}
        self.sent = 0.0
        self.events: list[tuple[float, str]] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            self.sent = time.perf_counter()
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=3600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if self.stop.is_set():
                        break
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        self.error = obj["error"]["message"]
                        continue
                    ch = obj["choices"][0]
                    self.events.append((time.perf_counter(), ch["text"]))
                    self.finish = ch["finish_reason"] or self.finish
        except Exception as exc:  # noqa: BLE001 - reported in the result
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.events)

    def first_token_at(self) -> float | None:
        return next((t for t, text in self.events if text), None)

    def end(self) -> float:
        return self.events[-1][0] if self.events else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_config(name: str, flags: str, a: argparse.Namespace, sizes: list[int]) -> dict:
    port = free_port()
    server = ManagedServer(serve_argv(f"--model {a.model} --max-model-len {a.max_model_len} "
                                      f"--no-enable-prefix-caching {flags}", port), port, name).start()
    try:
        prompts = tokenized_prompts(server.url, sizes)
        Stream(server.url, a.model, "Hello", 8).run()  # warm-up
        streams = [Stream(server.url, a.model, STREAM_PROMPTS[i % len(STREAM_PROMPTS)], a.stream_tokens)
                   for i in range(a.streams)]
        for s in streams:
            s.start()
        while not all(len(s.events) >= 8 for s in streams):
            time.sleep(0.05)
        windows = {}
        for n, ids in prompts.items():
            new = Stream(server.url, a.model, ids, 4)
            new.run()  # in this thread: arrives now, returns after its 4 tokens
            windows[n] = (new.sent, new.first_token_at(), new)
        time.sleep(a.tail)
        for s in streams:  # they were asked for more than the run needs: end them here
            s.stop.set()
        for s in streams:
            s.join()
    finally:
        server.stop()
    return summarize(name, flags, streams, windows)


def summarize(name: str, flags: str, streams: list[Stream], windows: dict) -> dict:
    gaps = [(b[0] - a[0], b[0]) for s in streams for a, b in zip(s.events, s.events[1:])]
    first_window = min(sent for sent, _, _ in windows.values())
    rows = []
    for n, (sent, first, new) in windows.items():
        during = [g for g, t in gaps if sent < t <= (first or sent)]
        rows.append({"prompt_tokens": n, "ttft_s": None if first is None else first - sent,
                     "itl_p50_ms": 1e3 * pct(during, 0.5) if during else None,
                     "itl_p99_ms": 1e3 * pct(during, 0.99) if during else None,
                     "itl_max_ms": 1e3 * max(during) if during else None,
                     "stream_tokens_during": len(during), "text": new.text, "error": new.error})
    before = [g for g, t in gaps if t <= first_window]
    last_first = max((first or 0) for _, first, _ in windows.values())
    return {"config": name, "flags": flags, "rows": rows,
            "itl_before_p50_ms": 1e3 * statistics.median(before) if before else None,
            "streams": [{"text": s.text, "finish": s.finish, "error": s.error, "events": len(s.events)}
                        for s in streams],
            "streams_outlasted_prompts": all(s.end() > last_first and s.finish is None for s in streams)}


def markdown(report: dict) -> str:
    title = (f"{report['model']}: {report['streams']} greedy streams decoding while prompts of "
             f"{', '.join(str(n) for n in report['prompt_tokens'])} tokens arrive (one server per config)")
    header = ("| config | prompt tokens | stream ITL p50 | p99 | longest | stream tokens during prefill | "
              "new prompt's TTFT | outputs identical |")
    lines = [title, "", header, "|---|---:|---:|---:|---:|---:|---:|:---:|"]

    def ms(x):
        return "-" if x is None else f"{x:.0f} ms"

    for r in report["results"]:
        for row in r["rows"]:
            lines.append(f"| {r['config']} (`{r['flags'].strip() or 'defaults'}`) | {row['prompt_tokens']:,} | "
                         f"{ms(row['itl_p50_ms'])} | {ms(row['itl_p99_ms'])} | {ms(row['itl_max_ms'])} | "
                         f"{row['stream_tokens_during']} | {row['ttft_s']:.2f} s | "
                         f"{'yes' if report['identical'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", default="4096,8000")
    ap.add_argument("--stream-tokens", type=int, default=3000, help="asked for; streams end after the last prompt")
    ap.add_argument("--tail", type=float, default=2.0, help="seconds the streams run on after the last prompt")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--config", action="append", default=None, help="NAME=SERVE_FLAGS (repeatable)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    configs = [c.partition("=")[::2] for c in (a.config or ["off=--max-step-ms 0", "on="])]
    sizes = [int(x) for x in a.prompt_tokens.split(",")]
    results = []
    for name, flags in configs:
        results.append(run_config(name, flags, a, sizes))
        r = results[-1]
        print(json.dumps({k: v for k, v in r.items() if k != "streams"} | {
            "rows": [{k: v for k, v in row.items() if k != "text"} for row in r["rows"]]}), flush=True)
    ref = results[0]
    # every stream's text up to where the shortest run of it ended, and every long prompt's answer
    common = [min(len(r["streams"][i]["text"]) for r in results) for i in range(a.streams)]
    identical = all(r["streams"][i]["text"][:n] == ref["streams"][i]["text"][:n]
                    for r in results for i, n in enumerate(common))
    identical &= all([row["text"] for row in r["rows"]] == [row["text"] for row in ref["rows"]] for r in results)
    clean = all(s["error"] is None for r in results for s in r["streams"] + r["rows"])
    report = {"model": a.model, "streams": a.streams, "prompt_tokens": sizes, "compared_stream_chars": common,
              "identical": identical and clean and min(common) > 0, "results": results}
    md = markdown(report)
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md + "\n")
    outlasted = all(r["streams_outlasted_prompts"] for r in results)
    if not outlasted:
        print("a stream ended before the last prompt's first token; raise --stream-tokens", file=sys.stderr)
    return 0 if report["identical"] and outlasted else 1


def tokenized_prompts(url: str, sizes: list[int]) -> dict[int, list[int]]:
    """Token ids of each long prompt (the server's /tokenize), cut to its size; distinct texts, so
    no prefix is shared."""
    out = {}
    for i, n in enumerate(sizes):
        r = httpx.post(url + "/tokenize", json={"prompt": long_text(i, n), "add_special_tokens": False}, timeout=600)
        ids = r.json()["tokens"]
        assert len(ids) >= n, (len(ids), n)
        out[n] = ids[:n]
    return out


if __name__ == "__main__":
    sys.exit(main())
