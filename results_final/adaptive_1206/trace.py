"""What the adaptive policy chose, step by step, for qwen2.5-coder-1.5b with the 4-bit 32K-vocabulary
0.5b draft (k <= 8): per prompt the decode tok/s, and for the slowest one each step's acceptance
estimate and k ("[0.48 k0]") followed by drafted/accepted; then the cost tables the policy used
(the target's per verification width, the draft model's per forward width, ms) beside the median
time of the target's forwards per width measured around them in the engine.

    python results_final/adaptive_1206/trace.py [--passes 2]

(README "A sequence stuck at k = 0"; a stall is a chance event: it showed in 2 of 4 runs.)
"""

import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import spec_decode as sd  # noqa: E402
from specserve.bench.suites import load_suites  # noqa: E402
from specserve.speculative import adaptive  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=2)
    a = ap.parse_args()
    eng = sd.fast_draft_engine()
    prompts = [ids for _, _, ids in sd.chat_prompts(eng.tokenizer, load_suites("code,math", 2))]
    sd.run_one(eng, prompts[0], 8)
    log: list = []
    lengths, learn = adaptive.DraftPolicy.lengths, adaptive.DraftPolicy.learn

    def traced_lengths(self, seqs, limits, extra_width=0):
        before = seqs[0].accept_ema  # (None for a new sequence: the policy starts it at its prior)
        ks = lengths(self, seqs, limits, extra_width)
        log.append((before, ks[0]))
        return ks

    def traced_learn(self, seq, nd, na, cut=False):
        log.append(("learn", nd, na))
        return learn(self, seq, nd, na, cut)

    adaptive.DraftPolicy.lengths, adaptive.DraftPolicy.learn = traced_lengths, traced_learn
    widths = collections.defaultdict(list)
    forward = eng.model.forward

    def timed(batch, *x, **kw):
        t = time.perf_counter()
        out = forward(batch, *x, **kw)
        widths[int(batch.input_ids.shape[0])].append(time.perf_counter() - t)
        return out

    eng.model.forward = timed
    for p in range(a.passes):
        runs = []
        for i, ids in enumerate(prompts):
            log.clear()
            r = sd.run_one(eng, ids, 128)
            runs.append((r["decode_tps"], i, list(log)))
            print(f"pass {p + 1} prompt {i}: {r['decode_tps']:.1f} tok/s {r.get('spec')}")
        tps, i, steps = min(runs)
        print(f"pass {p + 1}, slowest (prompt {i}):", " ".join(
            f"{e[2]}/{e[1]}" if e[0] == "learn" else f"[{'new' if e[0] is None else f'{e[0]:.2f}'} k{e[1]}]"
            for e in steps))
    ms = lambda table: {w: round(t * 1e3, 1) for w, t in sorted(table.items()) if w <= 10}  # noqa: E731
    print("target cost table (ms):", ms(eng.cost.table))
    print("target forwards, median ms (count):",
          {w: (round(1e3 * statistics.median(v), 1), len(v)) for w, v in sorted(widths.items()) if w <= 10})
    print("draft cost table (ms):", {w: round(t * 1e3, 1) for w, t in sorted(eng.drafter.cost.table.items())})


if __name__ == "__main__":
    main()
