"""Whether our decode's two speeds follow the memory's: in one process, in turn, a plain read of 1 GiB
(torch's sum, 2 threads: GB/s) and 2 requests of 64 decoded tokens on the 4-layer
Qwen3.5-35B-A3B-shaped file (ms a token), 12 times.

    python results_final/zen4_1207e/bandwidth_modes.py > results_final/zen4_1207e/bandwidth_modes.txt
"""

import time

import torch

from specserve.engine.types import SamplingParams

from moe_model import decoding_engine


def main() -> None:
    _, eng = decoding_engine(max_model_len=512, max_tokens=1)
    buf = torch.ones(1 << 28)  # 1 GiB of float32
    buf.sum()
    for turn in range(12):
        t = time.perf_counter()
        for _ in range(3):
            buf.sum()
        gbs = 3 * buf.numel() * 4 / (time.perf_counter() - t) / 1e9
        ms = []
        for r in range(2):
            t0 = None
            for i, _ in enumerate(eng.generate(list(range(100 + r, 116 + r)),
                                               SamplingParams(max_tokens=65, ignore_eos=True), request_id=f"{turn}.{r}")):
                if i == 0:
                    t0 = time.perf_counter()
            ms.append((time.perf_counter() - t0) / 64 * 1e3)
        print(f"turn {turn}: plain read {gbs:.1f} GB/s; decode " + " ".join(f"{x:.1f}" for x in ms) + " ms a token",
              flush=True)


if __name__ == "__main__":
    main()
