"""Requests that share a prefix and arrive together: computed once (a request waits for the running
prefill of its prefix) against every request prefilling it in the same steps.

    python benchmarks/shared_prefix_burst.py [--model smollm2-135m] [--requests 8] [--prefix-tokens 1024]
        [--tokens 16] [--rounds 2] [--out r.json] [--markdown r.md]

In one process, one engine; two cases of --requests requests added at the same moment, greedy,
--tokens tokens each: "n choices" (one prompt --requests times, as a request with n does) and
"burst" (a shared --prefix-tokens system text, then a different short question each). Each case
runs with the waiting on ("shared") and off ("each its own": the scheduler's check patched out,
what every request did before), alternating, --rounds times, each run in a fresh engine (an empty
prefix cache) around the one loaded model. Reported per case and mode: prompt tokens the engine
computed (prompt tokens less the cached tokens each request reports, as `timings.prompt_n`), time
to first token (median and last request), time until every request finished (medians over the
rounds), and whether every output equals the other mode's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specserve.commands.args import add_engine_args  # noqa: E402
from specserve.engine.builder import build_parts  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402

WORDS = ("harbour ledger clerk bridge council tide lantern archive copper signal route ferry warden "
         "granite orchard census beacon timber mill quarry vessel charter market furnace canal").split()


def cases(tok, a: argparse.Namespace) -> dict[str, list[list[int]]]:
    text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(a.prefix_tokens * 2))
    prefix = tok.encode(text)[:a.prefix_tokens]
    questions = [tok.encode(f" Question {i}: which {WORDS[i % len(WORDS)]} came first, and why?")
                 for i in range(a.requests)]
    return {"n choices": [prefix + questions[0]] * a.requests, "burst": [prefix + q for q in questions]}


def run(parts, prompts: list[list[int]], tokens: int, shared: bool) -> dict:
    engine = LLMEngine(parts.target, parts.ecfg, parts.speculative, parts.drafter)
    if not shared:
        engine.scheduler._prefix_in_flight = lambda seq: False  # noqa: SLF001 (the behaviour before the change)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    out, first, done = {r: [] for r in ids}, {}, {}
    while len(done) < len(ids):
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            first.setdefault(o.request_id, time.perf_counter() - t0)
            if o.finished:
                done[o.request_id] = (time.perf_counter() - t0, o.prompt_tokens - o.cached_tokens)
    ttft = sorted(first.values())
    return {"computed": sum(n for _, n in done.values()), "ttft_median": statistics.median(ttft),
            "ttft_last": ttft[-1], "all_done": max(t for t, _ in done.values()), "tokens": [out[r] for r in ids]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    p = argparse.ArgumentParser()
    add_engine_args(p)
    parts = build_parts(p.parse_args(["--model", a.model, "--max-num-seqs", str(a.requests)]))
    results = []
    for case, prompts in cases(parts.target.tokenizer, a).items():
        runs = {True: [], False: []}
        for rnd in range(a.rounds):
            for shared in ((True, False) if rnd % 2 == 0 else (False, True)):
                runs[shared].append(run(parts, prompts, a.tokens, shared))
        same = all(r["tokens"] == runs[True][0]["tokens"] for rs in runs.values() for r in rs)
        for shared, rs in runs.items():
            row = {"case": case, "mode": "shared" if shared else "each its own", "identical": same,
                   **{k: statistics.median(r[k] for r in rs) for k in ("computed", "ttft_median", "ttft_last",
                                                                        "all_done")}}
            results.append(row)
            print(row, file=sys.stderr, flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    md = [f"`benchmarks/shared_prefix_burst.py --model {a.model} --requests {a.requests} --prefix-tokens "
          f"{a.prefix_tokens} --tokens {a.tokens} --rounds {a.rounds}` on {cpu}, {os.cpu_count()} cores "
          "(medians over the rounds):", "",
          "| case | mode | prompt tokens computed | TTFT median s | TTFT last s | all done s | outputs identical |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {r['case']} | {r['mode']} | {r['computed']:.0f} | {r['ttft_median']:.2f} | {r['ttft_last']:.2f} | "
           f"{r['all_done']:.2f} | {'yes' if r['identical'] else 'NO'} |" for r in results]
    print("\n".join(md))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(md) + "\n")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
