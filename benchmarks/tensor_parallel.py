"""Tensor parallel on this machine: TP=1 with every core against TP=2 with a core per rank.

    python benchmarks/tensor_parallel.py [--model qwen2.5-coder-0.5b] [--tokens 128] [--runs 3]

Each case runs in its own process, one after another (never two at once):
  tp1:          one process, --threads = the cores (the fused C decoder stack);
  tp1-unfused:  the same on the per-op Python path (for reference: what the fused C stack saves;
                a rank runs the fused stack, its all-reduces a callback from inside it);
  tp2:          -tp 2, one thread per rank, each rank pinned to its core (gloo point-to-point
                on loopback: 48 all-reduces of one [T, 896] row block per step for this model).
Prints decode tok/s of one stream (median of --runs after a warm-up, greedy, EOS ignored) and
of 8 streams together, each as a ratio to tp1, then how many of 16 prompts keep TP=1's first
32 greedy tokens under TP=2 (the all-reduce adds partial sums in another order, so a near tie
may flip; speculation under TP=2 is exact against TP=2, see tests/test_tensor_parallel.py).
``--check-fp32`` instead compares TP=2's fp32 logits of one prompt with TP=1's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

CASES = {"tp1": [], "tp1-unfused": [], "tp2": ["-tp", "2"]}


def _engine(model: str, extra: list[str], threads: int):
    from specserve.commands.args import add_engine_args
    from specserve.engine.builder import build_engine

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return build_engine(p.parse_args(["--model", model, "--max-model-len", "1024", "--kv-cache-memory", "1GiB",
                                      "--threads", str(threads), *extra]))


def _prompts(engine, n: int) -> list[list[int]]:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from engine_utils import bench_prompts, chat_ids

    return [chat_ids(engine, t) for t in bench_prompts(-(-n // 3))[:n]]


def _rate(engine, ids: list[int], tokens: int, rid: str) -> float:
    from specserve.engine.types import SamplingParams

    stamps = []
    for out in engine.generate(ids, SamplingParams(max_tokens=tokens, ignore_eos=True), rid):
        stamps += [time.perf_counter()] * len(out.new_token_ids)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _batch_rate(engine, prompts: list[list[int]], tokens: int) -> float:
    from specserve.engine.types import SamplingParams

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from engine_utils import run_all

    run_all(engine, [p[:8] for p in prompts], SamplingParams(max_tokens=2, ignore_eos=True))  # warm
    t0 = time.perf_counter()
    got = run_all(engine, prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    return sum(len(g) for g in got) / (time.perf_counter() - t0)


def child(case: str, model: str, tokens: int, runs: int) -> dict:
    from specserve.engine.types import SamplingParams

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from engine_utils import run_all

    cores = len(os.sched_getaffinity(0))
    engine = _engine(model, CASES[case], 1 if case == "tp2" else cores)
    if case == "tp1-unfused":
        engine.model.fused = False
    prompts = _prompts(engine, 16)
    rates = [_rate(engine, prompts[0], tokens, f"r{i}") for i in range(runs + 1)][1:]
    batch = _batch_rate(engine, prompts[:8], tokens // 2)
    greedy = run_all(engine, prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    engine.close()
    return {"decode": statistics.median(rates), "batch8": batch, "greedy": greedy}


def logits_child(case: str, model: str) -> dict:
    """fp32 (--quantization none) logits of every position of one prompt, TP=1 or TP=2."""
    from specserve.engine.types import SamplingParams

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from engine_utils import logits_of_every_position

    engine = _engine(model, [*CASES[case], "--quantization", "none"], 1 if case == "tp2" else len(os.sched_getaffinity(0)))
    ids = _prompts(engine, 1)[0]
    engine.add_request("x", ids, SamplingParams(max_tokens=1))
    logits = logits_of_every_position(engine, "x")[0][:len(ids)]
    engine.close()
    return {"logits": logits.tolist()}


def check_fp32(model: str) -> None:
    """--check-fp32: how close TP=2's fp32 logits are to TP=1's (no weight quantization noise)."""
    import torch

    got = {}
    for case in ("tp1", "tp2"):
        out = subprocess.run([sys.executable, __file__, "--logits-child", case, "--model", model],
                             capture_output=True, text=True, check=True).stdout
        got[case] = torch.tensor(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
                                 ["logits"])
    a, b = got["tp1"], got["tp2"]
    same = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"fp32 logits, {a.shape[0]} positions: max |TP=2 - TP=1| {(a - b).abs().max().item():.1e} "
          f"(logit std {a.std().item():.2f}); argmax equal at {same:.0%} of positions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--check-fp32", action="store_true",
                    help="instead: compare TP=2's fp32 logits with TP=1's on one prompt")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--logits-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.logits_child:
        print("RESULT " + json.dumps(logits_child(a.logits_child, a.model)))
        return
    if a.check_fp32:
        check_fp32(a.model)
        return
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.model, a.tokens, a.runs)))
        return
    results = {}
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--child", case, "--model", a.model, "--tokens",
                              str(a.tokens), "--runs", str(a.runs)], capture_output=True, text=True, check=True).stdout
        results[case] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    base = results["tp1"]
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"{a.model}, {len(os.sched_getaffinity(0))} cores ({cpu})\n")
    print("| case | decode tok/s (1 stream) | vs tp1 | tok/s (8 streams) | vs tp1 |")
    print("|---|---|---|---|---|")
    for case, r in results.items():
        print(f"| {case} | {r['decode']:.1f} | {r['decode'] / base['decode']:.2f}x | {r['batch8']:.1f} | "
              f"{r['batch8'] / base['batch8']:.2f}x |")
    same = sum(x == y for x, y in zip(results["tp2"]["greedy"], base["greedy"]))
    print(f"\nTP=2 keeps TP=1's first 32 greedy tokens on {same} of {len(base['greedy'])} prompts")


if __name__ == "__main__":
    main()
