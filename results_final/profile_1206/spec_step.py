"""Where a speculative step of qwen2.5-coder-1.5b with the 4-bit 32K-vocabulary 0.5b draft goes:
the code and math suites' first two prompts, 128 tokens each, greedy, adaptive k <= 8, with
timers around the drafter's propose, the draft model's forward and the target's forward.

    python results_final/profile_1206/spec_step.py

Prints per prompt tok/s and steps, then ms per step of drafting (of it the draft forwards, and
what is left: the draft vocabulary's head, picking, bookkeeping) and of the target's forwards
(prefills included: four short chat prompts).
"""

import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import spec_decode as sd  # noqa: E402
from specserve.bench.suites import load_suites  # noqa: E402


def timer(obj, name: str, acc: dict, key: str) -> None:
    f = getattr(obj, name)

    def timed(*args, **kw):
        t = time.perf_counter()
        out = f(*args, **kw)
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
        acc["n_" + key] = acc.get("n_" + key, 0) + 1
        return out

    setattr(obj, name, timed)


def main() -> None:
    eng = sd.fast_draft_engine()
    prompts = [ids for _, _, ids in sd.chat_prompts(eng.tokenizer, load_suites("code,math", 2))]
    sd.run_one(eng, prompts[0], 8)
    acc: dict = {}
    timer(eng.drafter, "propose", acc, "propose")
    timer(eng.drafter.model, "forward", acc, "draft_forward")
    timer(eng.model, "forward", acc, "target_forward")
    decode = 0.0
    for ids in prompts:
        r = sd.run_one(eng, ids, 128)
        decode += r["decode_s"]
        print(f"{r['decode_tps']:.1f} tok/s {r.get('spec')}")
    steps = acc["n_propose"]
    fwd = acc["n_draft_forward"]
    print(f"{steps} steps, {1e3 * decode / steps:.1f} ms each: drafting {1e3 * acc['propose'] / steps:.1f} ms "
          f"({fwd / steps:.2f} draft forwards of {1e3 * acc['draft_forward'] / fwd:.2f} ms, "
          f"{1e3 * (acc['propose'] - acc['draft_forward']) / steps:.1f} ms besides); target forwards "
          f"{1e3 * acc['target_forward'] / steps:.1f} ms a step with the prefills")

if __name__ == "__main__":
    main()
