"""The prefetch hint timed on random Q4_K matrices instead of a model (the contest tried first and
dropped): sets of qwen2.5-coder-1.5b's MLP shapes, one-row panel linears, the two hints taking turns,
best of 20; prints t0 / t1 per set. Run it in several processes to see the spread:

    for i in 1 2 3; do python results_final/zen5_1206/prefetch_matrices.py; done \
        > results_final/zen5_1206/prefetch_matrices.txt
"""

import time

import torch

from specserve.kernels import library, tune
from specserve.kernels.linear import linear

SETS = {"up x10": [(8960, 1536)] * 10, "up/down x10": [(8960, 1536), (1536, 8960)] * 5,
        "up/down x16": [(8960, 1536), (1536, 8960)] * 8, "4096 x4096 x10": [(4096, 4096)] * 10}


def main() -> None:
    g = torch.Generator().manual_seed(0)
    out = []
    try:
        for label, shapes in SETS.items():
            ws = [tune.random_block_weight("Q4_K", n, k, g) for n, k in shapes]
            xs = {k: torch.randn(1, k, generator=g) for _, k in shapes}

            def run() -> None:
                for w in ws:
                    linear(xs[w.k], w)

            run()
            best = {"t1": float("inf"), "t0": float("inf")}
            for _ in range(20):
                for hint in best:
                    library.set_prefetch_t0(hint == "t0")
                    t0 = time.perf_counter()
                    run()
                    best[hint] = min(best[hint], time.perf_counter() - t0)
            out.append(f"{label} {best['t0'] / best['t1']:.3f} (t1 {best['t1'] * 1e3:.2f} ms)")
    finally:
        library.set_prefetch_t0(False)
    print("t0/t1: " + "; ".join(out), flush=True)


if __name__ == "__main__":
    main()
