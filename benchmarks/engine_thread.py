"""Decode tok/s of one engine stepped from different threads (why `serve` steps in the main thread).

    python benchmarks/engine_thread.py [--model smollm2-135m] [--tokens 128] [--runs 2]

Three cases, each in its own process so OpenMP state does not carry over:
  main:   engine built and stepped in the main thread (what `specserve serve` does now);
  other:  built in the main thread, stepped from a second thread (the old server layout);
  own:    built and stepped in the same second thread.
Prints the median decode tok/s of each (greedy, EOS ignored, one request at a time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROMPT = "Write a long story about a lighthouse keeper."


def _build(model: str):
    from specserve.commands.args import add_engine_args
    from specserve.engine.builder import build_engine

    p = argparse.ArgumentParser()
    add_engine_args(p)
    engine = build_engine(p.parse_args(["--model", model]))
    return engine, engine.tokenizer.encode(PROMPT)


def _decode_rates(engine, ids: list[int], tokens: int, runs: int) -> list[float]:
    from specserve.engine.types import SamplingParams

    rates = []
    for i in range(runs + 1):  # the first run warms up
        stamps = []
        for out in engine.generate(ids, SamplingParams(max_tokens=tokens, ignore_eos=True), f"r{i}"):
            stamps += [time.perf_counter()] * len(out.new_token_ids)
        if i:
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return rates


def child(case: str, model: str, tokens: int, runs: int) -> None:
    result: list[float] = []
    if case == "main":
        result = _decode_rates(*_build(model), tokens, runs)
    elif case == "other":
        built = _build(model)
        th = threading.Thread(target=lambda: result.extend(_decode_rates(*built, tokens, runs)))
        th.start()
        th.join()
    else:
        th = threading.Thread(target=lambda: result.extend(_decode_rates(*_build(model), tokens, runs)))
        th.start()
        th.join()
    print(f"{statistics.median(result):.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.model, a.tokens, a.runs)
        return 0
    print("| engine built in | stepped from | decode tok/s |\n|---|---|---:|")
    for case, built, stepped in (("main", "main thread", "main thread"), ("other", "main thread", "second thread"),
                                 ("own", "second thread", "second thread")):
        out = subprocess.run([sys.executable, __file__, "--child", case, "--model", a.model, "--tokens",
                              str(a.tokens), "--runs", str(a.runs)], capture_output=True, text=True, check=True)
        print(f"| {built} | {stepped} | {out.stdout.strip().splitlines()[-1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
