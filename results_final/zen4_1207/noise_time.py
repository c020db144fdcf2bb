"""One position's noise, old and new, at the catalog's vocabulary sizes (2026-12-07, fifth session).

    python results_final/zen4_1207/noise_time.py

Old: -log of torch.rand from a generator seeded per position (the code before this session's
change). New: -log of kernels/noise.py's counter-based uniforms (C, and the torch fallback).
Median of 200 draws each, in ms.
"""

from __future__ import annotations

import statistics
import time

import torch

from specserve.kernels.noise import uniform_noise


def old(n: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(12345)
    return -torch.log(torch.rand(n, generator=g))


def timed(fn, n: int) -> float:
    times = []
    for _ in range(200):
        t = time.perf_counter()
        fn(n)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    print("| vocabulary | torch generator (old) | counter-based, C (new) | counter-based, torch fallback |")
    print("|---|---|---|---|")
    for name, n in (("smollm2-135m", 49152), ("gemma3-270m", 262144), ("qwen2.5", 151936)):
        cells = [timed(old, n), timed(lambda m: -torch.log(uniform_noise(7, m, impl="c")), n),
                 timed(lambda m: -torch.log(uniform_noise(7, m, impl="torch")), n)]
        print(f"| {name} ({n}) | " + " | ".join(f"{c:.3f} ms" for c in cells) + " |")


if __name__ == "__main__":
    main()
