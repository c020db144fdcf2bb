"""What sampling by each position's noise costs a seeded request (2026-12-07, fourth session).

    python results_final/zen5_1207d/seeded_cost.py [MODEL] [ROUNDS]

One process, one target loaded once, a plain and an ngram engine around it (benchmarks/spec_decode.py's
engines). Each round runs the code suite's first three prompts, 128 tokens at temperature 0.7
with EOS ignored, on both engines, unseeded (a uniform a token; rejection sampling under ngram)
and seeded (each position's exponential noise, sampler.PositionNoise; seeds 100 x round + prompt,
so each round samples anew, as the unseeded requests do), taking turns. Prints the median decode
tok/s of each cell and the seeded / unseeded ratio, and checks that every seeded request's tokens
are the same with ngram as without.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import spec_decode as sd  # noqa: E402

from specserve.bench.suites import load_suites  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    engines = sd.make_engines(model, [("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 8})],
                              argparse.Namespace(quantization="auto", ctx=4096, threads=None))
    for e in engines.values():
        sd.warm_up(e)
    prompts = sd.chat_prompts(engines["plain"].tokenizer, {"code": load_suites("code")["code"][:3]})
    tps: dict[tuple[str, bool], list[float]] = {}
    seeded_tokens: dict[tuple[str, int], list[list[int]]] = {}
    for rnd in range(rounds):
        for name, e in engines.items():
            for seeded in (False, True):
                for i, (_, _, ids) in enumerate(prompts):  # a new seed each round: a new sample, as unseeded
                    params = SamplingParams(max_tokens=128, temperature=0.7, seed=100 * rnd + i if seeded else None,
                                            ignore_eos=True)
                    r = sd.run_one(e, ids, 128, params)
                    tps.setdefault((name, seeded), []).append(r["decode_tps"])
                    if seeded:
                        seeded_tokens.setdefault((rnd, i), []).append(r["tokens"])
    print(f"{model}, {rounds} rounds x {len(prompts)} prompts, 128 tokens, temperature 0.7 (median decode tok/s)")
    print("| engine | unseeded | seeded | seeded / unseeded |")
    print("|---|---|---|---|")
    for name in engines:
        a, b = statistics.median(tps[(name, False)]), statistics.median(tps[(name, True)])
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    same = sum(runs[0] == runs[1] for runs in seeded_tokens.values())
    print(f"seeded requests whose tokens with ngram equal those without: {same}/{len(seeded_tokens)}")


if __name__ == "__main__":
    main()
