"""Greedy decoding's argmax over one row of 248,320 logits (Qwen3.5's vocabulary) and of 151,936
(qwen2.5-coder's): ops.argmax_rows (C) against torch.argmax, ms a call, median of 5 rounds of 500.

    python results_final/zen4_1207e/argmax_time.py > results_final/zen4_1207e/argmax_time.txt
"""

import statistics
import time

import torch

from specserve.kernels import ops


def ms(fn, n: int = 500) -> float:
    fn()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t) / n * 1e3)
    return statistics.median(rounds)


def main() -> None:
    for vocab in (248_320, 151_936):
        x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
        assert ops.argmax_rows(x) == x.argmax(-1).tolist()
        print(f"vocabulary {vocab}: argmax_rows {ms(lambda: ops.argmax_rows(x)):.3f} ms, "
              f"torch.argmax(...).tolist() {ms(lambda: x.argmax(-1).tolist()):.3f} ms")


if __name__ == "__main__":
    main()
