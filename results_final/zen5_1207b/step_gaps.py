"""A decode step's wall time against what the policy priced it at, by draft length (2026-12-07, Zen 5).

qwen2.5-coder-1.5b with the 0.5b draft (q4_0, 32K draft vocabulary, k <= 5, adaptive), one engine, and
plain in a second; after a short warm-up request each answers long-argparse (long.jsonl, 1,548 tokens)
twice, TOKENS tokens. Per k: steps, the median wall time of the engine's step (scheduling, drafting,
verification, bookkeeping), the median price the policy gave it (the forwards' times, and, since
2026-12-07b, the step's gap beyond them), and the median acceptance estimate. Then each engine's gaps.

    python results_final/zen5_1207b/step_gaps.py [TOKENS] > results_final/zen5_1207b/step_gaps.txt

step_gaps.txt was taken with step_gaps.patch applied (``git apply``: the policy keeps each kind of
step's gap and adds it to the price). The change was not kept (README "A step's time beyond its
forwards"); without it, "priced" is the forwards' time alone and no gaps are printed.
"""
import argparse
import statistics
import sys
import time

from policy_variants import long_messages, sd

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 128
engs = sd.make_engines("qwen2.5-coder-1.5b", [("plain", None), ("draft", dict(sd.FAST_DRAFT, adaptive=True))],
                       argparse.Namespace(quantization="auto", ctx=8192, threads=None))
ids = sd.chat_ids(engs["draft"].tokenizer, long_messages())


def trace(eng):
    """Per decode step: (k, the policy's price, its estimate, the step's wall time)."""
    steps, chosen, lengths, step = [], [], eng.policy.lengths, eng.step

    def traced_lengths(seqs, limits, extra_width=0):
        ks = lengths(seqs, limits, extra_width)
        if not extra_width:
            chosen.append((ks[0], eng.policy._time(len(seqs) + sum(ks), ks), seqs[0].accept_ema))
        return ks

    def traced_step():
        n, t = len(chosen), time.perf_counter()
        out = step()
        if len(chosen) > n:
            steps.append(chosen[-1] + (time.perf_counter() - t,))
        return out

    eng.policy.lengths, eng.step = traced_lengths, traced_step
    return steps


for name, eng in engs.items():
    steps = trace(eng)
    sd.warm_up(eng)
    for rep in range(2):
        steps.clear()
        r = sd.run_one(eng, ids, TOKENS)
        print(f"{name}, answer {rep + 1}: {r['decode_tps']:.1f} tok/s {r.get('spec') or ''}")
        for k in sorted({s[0] for s in steps}):
            ss = [s for s in steps if s[0] == k]
            print(f"  k={k}: {len(ss)} steps, wall {statistics.median(s[3] for s in ss) * 1e3:.1f} ms, priced "
                  f"{statistics.median(s[1] for s in ss) * 1e3:.1f} ms, "
                  f"estimate {statistics.median(s[2] for s in ss):.2f}")
    if hasattr(eng.policy, "gap"):  # (step_gaps.patch)
        print(f"{name}: gap drafting {eng.policy.gap(True) * 1e3:.2f} ms, plain {eng.policy.gap(False) * 1e3:.2f} ms")
