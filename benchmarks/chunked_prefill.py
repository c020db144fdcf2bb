"""Inter-token latency of a running stream while a long prompt arrives, with and without chunking.

    python benchmarks/chunked_prefill.py [--model smollm2-135m] [--prompt-tokens 4096]
        [--chunks 256,512,8192] [--tokens 160] [--arrive-after 32] [--markdown out.md] [--out out.json]

One engine per --max-num-batched-tokens value (in-process, the same engine the server runs),
with fixed chunks (--max-step-ms 0; benchmarks/prefill_stall.py measures the time budget).
Stream A decodes --tokens tokens; after its --arrive-after-th token a second request B with a
--prompt-tokens-token prompt arrives. Every gap between two of A's tokens is timed. Without
chunking (a budget >= the prompt) B's whole prefill runs in one step and A waits for all of it;
with chunking A gets a token after every chunk. Reported per budget: A's median gap before B
arrives, its longest gap and p95 while B prefills, the time until B's first token, and whether
A's tokens equal those of an undisturbed run (batch invariance: they must).
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
from specserve.engine.builder import build_engine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402

TEXT = ("The archive keeps every ledger of the harbour since the old bridge was built. Clerks copy the "
        "entries by hand, compare totals at the end of each week, and send a summary to the council. ")


def engine_for(model: str, budget: int, max_len: int):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return build_engine(p.parse_args(["--model", model, "--max-num-batched-tokens", str(budget),
                                      "--max-model-len", str(max_len), "--max-num-seqs", "2",
                                      "--no-enable-prefix-caching", "--max-step-ms", "0"]))  # fixed chunks


def run_once(engine, a_ids: list[int], b_ids: list[int], tokens: int, arrive_after: int) -> dict:
    """Decode A; B arrives after A's arrive_after-th token. Returns A's gaps and tokens."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.add_request("A", a_ids, params)
    stamps, a_tokens, b_sent, b_arrived, b_first = [], [], False, None, None
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == "A" and out.new_token_ids:
                a_tokens += out.new_token_ids
                stamps += [now] * len(out.new_token_ids)
            if out.request_id == "B" and out.new_token_ids and b_first is None:
                b_first = now - b_arrived
        if not b_sent and len(a_tokens) >= arrive_after:
            engine.add_request("B", b_ids, SamplingParams(max_tokens=4, ignore_eos=True))
            b_sent, b_arrived = True, time.perf_counter()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    before = gaps[:arrive_after - 1]
    # A's gaps from B's arrival until B's first token (the prefill), plus the gap spanning the arrival
    during = [g for g, t in zip(gaps, stamps[1:]) if t > b_arrived and t - g < b_arrived + (b_first or 0)]
    return {"tokens": a_tokens, "before": before, "during": during, "b_ttft_s": b_first}


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunks", default="256,512,8192", help="--max-num-batched-tokens values to compare")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--arrive-after", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    budgets = [int(x) for x in a.chunks.split(",")]
    max_len = a.prompt_tokens + 64
    results, reference = [], None
    for budget in budgets:
        engine = engine_for(a.model, budget, max(max_len, a.tokens + 64))
        tok = engine.tokenizer
        a_ids = tok.encode("Write a long story about a lighthouse keeper and the sea.")
        b_ids = (tok.encode(TEXT * (a.prompt_tokens // 30 + 1)))[:a.prompt_tokens]
        run_once(engine, a_ids[:8], b_ids[:64], 8, 4)  # warm-up: kernels, allocator
        if reference is None:  # A alone, undisturbed
            reference = _alone(engine, a_ids, a.tokens)
        r = run_once(engine, a_ids, b_ids, a.tokens, a.arrive_after)
        row = {"max_num_batched_tokens": budget, "chunked": budget < a.prompt_tokens,
               "itl_before_ms": 1e3 * statistics.median(r["before"]),
               "itl_max_during_ms": 1e3 * max(r["during"]) if r["during"] else None,
               "itl_p95_during_ms": 1e3 * p95(r["during"]) if r["during"] else None,
               "a_tokens_during_prefill": len(r["during"]),
               "b_ttft_s": r["b_ttft_s"], "a_identical": r["tokens"] == reference}
        print(json.dumps(row), flush=True)
        results.append(row)
        del engine
    report = {"model": a.model, "prompt_tokens": a.prompt_tokens, "tokens": a.tokens,
              "arrive_after": a.arrive_after, "rows": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    md = markdown(report)
    print(md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md + "\n")
    return 0 if all(r["a_identical"] for r in results) else 1


def _alone(engine, ids: list[int], n: int) -> list[int]:
    engine.add_request("alone", ids, SamplingParams(max_tokens=n, ignore_eos=True))
    got = []
    while engine.has_work():
        got += [t for out in engine.step() for t in out.new_token_ids]
    return got


def markdown(report: dict) -> str:
    lines = [f"{report['model']}: a stream decoding while a {report['prompt_tokens']}-token prompt arrives "
             f"(in-process engine, greedy)", "",
             "| --max-num-batched-tokens | chunked | ITL before (median) | longest ITL during prefill | "
             "p95 ITL during | stream tokens during prefill | new prompt's TTFT | stream tokens identical |",
             "|---:|:---:|---:|---:|---:|---:|---:|:---:|"]
    for r in report["rows"]:
        def ms(x):
            return "-" if x is None else f"{x:.0f} ms"
        lines.append(f"| {r['max_num_batched_tokens']} | {'yes' if r['chunked'] else 'no'} | {ms(r['itl_before_ms'])} | "
                     f"{ms(r['itl_max_during_ms'])} | {ms(r['itl_p95_during_ms'])} | {r['a_tokens_during_prefill']} | "
                     f"{r['b_ttft_s']:.2f} s | {'yes' if r['a_identical'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
