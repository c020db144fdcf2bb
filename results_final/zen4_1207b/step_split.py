"""Where a speculative step of qwen2.5-coder-1.5b with the 4-bit 32K-vocabulary 0.5b draft goes,
by forward width: the code and math suites' first two prompts, 128 tokens each, greedy, adaptive
k <= 8 (the engine of benchmarks/spec_decode.py's fast_draft_engine), with timers around the
target's and the draft model's forwards (keyed by their row counts) and the drafter's proposals.

    python results_final/zen4_1207b/step_split.py > results_final/zen4_1207b/step_split.txt

Prints per prompt tok/s and the acceptance counts, then per width the count and median ms of the
target's forwards (the first of each request is its prefill) and of the draft's, and the totals.
"""

import collections
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import spec_decode as sd  # noqa: E402
from specserve.bench.suites import load_suites  # noqa: E402


def timed(fn, by_rows: dict):
    def wrapper(batch, kv, *args, **kw):
        t = time.perf_counter()
        out = fn(batch, kv, *args, **kw)
        by_rows[int(batch.input_ids.shape[0])].append(time.perf_counter() - t)
        return out
    return wrapper


def main() -> None:
    eng = sd.fast_draft_engine()
    prompts = [ids for _, _, ids in sd.chat_prompts(eng.tokenizer, load_suites("code,math", 2))]
    sd.run_one(eng, prompts[0], 8)
    target, draft, proposals = collections.defaultdict(list), collections.defaultdict(list), []
    eng.model.forward = timed(eng.model.forward, target)
    eng.drafter.model.forward = timed(eng.drafter.model.forward, draft)
    propose = eng.drafter.propose

    def timed_propose(*args, **kw):
        t = time.perf_counter()
        out = propose(*args, **kw)
        proposals.append(time.perf_counter() - t)
        return out

    eng.drafter.propose = timed_propose
    decode = 0.0
    for ids in prompts:
        r = sd.run_one(eng, ids, 128)
        decode += r["decode_s"]
        print(f"{r['decode_tps']:.1f} tok/s {r.get('spec')}")
    for name, by_rows in (("target", target), ("draft", draft)):
        for rows in sorted(by_rows):
            v = by_rows[rows]
            print(f"{name} rows={rows}: n={len(v)} median {1e3 * statistics.median(v):.2f} ms total "
                  f"{1e3 * sum(v):.0f}")
    print(f"propose n={len(proposals)} total {1e3 * sum(proposals):.0f} ms; draft forwards total "
          f"{1e3 * sum(sum(v) for v in draft.values()):.0f} ms; decode total {1e3 * decode:.0f} ms")


if __name__ == "__main__":
    main()
