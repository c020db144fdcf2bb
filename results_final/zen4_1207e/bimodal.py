"""Our decode of the 4-layer Qwen3.5-35B-A3B-shaped file (hybrid_speed.py --model 35b-a3b --layers 4)
request after request in one process: ms per token of 8 requests of 64 tokens, printed with LABEL.
Run as below, twice each, in turn: with libgomp's default wait policy and with OMP_WAIT_POLICY=active
(its threads spinning between parallel regions), to see whether our step's slow mode is the
threads falling asleep between kernel calls.

    for i in 1 2; do python results_final/zen4_1207e/bimodal.py default
        OMP_WAIT_POLICY=active python results_final/zen4_1207e/bimodal.py active; done
"""

import statistics
import sys
import time

from specserve.engine.types import SamplingParams

from moe_model import decoding_engine


def main() -> None:
    _, eng = decoding_engine(max_model_len=512, max_tokens=1)
    ms = []
    for r in range(8):
        t0 = None
        for i, _ in enumerate(eng.generate(list(range(100 + r, 116 + r)), SamplingParams(max_tokens=65, ignore_eos=True),
                                           request_id=f"t{r}")):
            if i == 0:
                t0 = time.perf_counter()
        ms.append((time.perf_counter() - t0) / 64 * 1e3)
    print(f"{sys.argv[1] if len(sys.argv) > 1 else ''}: " + " ".join(f"{x:.1f}" for x in ms)
          + f" ms a token; median {statistics.median(ms):.2f}")


if __name__ == "__main__":
    main()
