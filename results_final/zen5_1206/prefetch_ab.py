"""Plain decode with each weight-prefetch hint, in one process: qwen2.5-coder-1.5b (and its 0.5b),
the code / math / prose / edit suites' first 2 prompts each, 128 tokens, greedy; per prompt the two
hints take turns (the order alternating), and the tokens of both are compared. Prints what the
engine chose at start-up, decode tok/s per hint and the median paired ratio.

    python results_final/zen5_1206/prefetch_ab.py > results_final/zen5_1206/prefetch_ab.txt
"""

import argparse
import logging
import os
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import spec_decode as sd  # noqa: E402
from specserve.bench.suites import load_suites  # noqa: E402
from specserve.kernels.library import set_prefetch_t0  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    # since adb7d92 an engine chooses the hint by a trial over its first forwards, which would take
    # turns with this A/B's own setting: the hint is forced for the engine and set here per prompt
    os.environ["SPECSERVE_PREFETCH_HINT"] = "t1"
    for model in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        args = argparse.Namespace(quantization="auto", ctx=4096, threads=None)
        eng = sd.make_engines(model, [("plain", None)], args)["plain"]
        prompts = sd.chat_prompts(eng.tokenizer, load_suites("code,math,prose,edit", 2))
        sd.run_one(eng, prompts[0][2], 16)
        tps, ratios, same = {"t1": [], "t0": []}, [], 0
        for i, (suite, pid, ids) in enumerate(prompts):
            res = {}
            for hint in (("t1", "t0") if i % 2 == 0 else ("t0", "t1")):
                set_prefetch_t0(hint == "t0")
                res[hint] = sd.run_one(eng, ids, 128)
                tps[hint].append(res[hint]["decode_tps"])
            same += res["t0"]["tokens"] == res["t1"]["tokens"]
            ratios.append(res["t0"]["decode_tps"] / res["t1"]["decode_tps"])
            print(f"  {suite}/{pid}: t1 {res['t1']['decode_tps']:.1f} tok/s, t0 {res['t0']['decode_tps']:.1f}",
                  flush=True)
        print(f"{model}: median tok/s t1 {statistics.median(tps['t1']):.1f}, t0 {statistics.median(tps['t0']):.1f}; "
              f"t0/t1 median paired ratio {statistics.median(ratios):.3f} (lowest {min(ratios):.3f}); "
              f"same tokens {same}/{len(prompts)}", flush=True)
        del eng


if __name__ == "__main__":
    main()
