"""With bounded_head.patch (or bounded_head_c.patch) applied: a model's plain greedy decode with the
bounded head and with the full head, taking turns on one engine (the code, math and prose suites'
first two prompts, 64 tokens each; a model without a chat template reads the messages as plain
text), the tokens compared.

    git apply results_final/zen4_1207c/bounded_head.patch && python results_final/zen4_1207c/ab.py [MODEL]
"""
import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import spec_decode as sd  # noqa: E402
from specserve.bench.suites import load_suites  # noqa: E402


def main() -> None:
    t0 = time.time()
    ns = argparse.Namespace(quantization="auto", ctx=4096, threads=None)
    model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
    eng = sd.make_engines(model, [("plain", None)], ns)["plain"]
    print(f"engine built in {time.time() - t0:.1f} s (the bounded head's start-up included)")
    b = eng.runner.bounded
    suites = load_suites("code,math,prose", 2)
    if eng.tokenizer.chat_template:
        prompts = [ids for _, _, ids in sd.chat_prompts(eng.tokenizer, suites)]
    else:
        prompts = [eng.tokenizer.encode("\n".join(m["content"] for m in p.as_messages()) + "\n")
                   for ps in suites.values() for p in ps]
    sd.run_one(eng, prompts[0], 8)
    for ids in prompts:
        eng.runner.bounded = b
        r1 = sd.run_one(eng, ids, 64)
        eng.runner.bounded = None
        r0 = sd.run_one(eng, ids, 64)
        print(f"bounded {r1['decode_tps']:.1f} tok/s, full head {r0['decode_tps']:.1f}, "
              f"same tokens {r1['tokens'] == r0['tokens']}")
    print(f"{b.num_calls} calls: {b.num_full} read the full head; the rest {b.num_candidates / max(b.num_calls - b.num_full, 1):.0f} "
          "candidates on average")


if __name__ == "__main__":
    main()
