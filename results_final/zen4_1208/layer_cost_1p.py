"""Our cost of four Qwen3.5-35B-A3B-shaped layers (three Gated DeltaNet, one gated attention, each
with its MoE MLP), from the 8-layer and the 4-layer files (hybrid_speed.py --model 35b-a3b
--layers 8 / 4, random weights) decoding in ONE process, taking turns every 20 steps (8 turns), so
that both sides of the difference see the same memory speed (zen4_1207e/layer_cost.py ran each
engine's turn minutes apart, and its differences landed in different memory-speed modes). llama.cpp's
four layers, from that script's runs, held at 6.4-6.5 ms.

    python results_final/zen4_1208/layer_cost_1p.py > results_final/zen4_1208/layer_cost_1p.txt
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zen4_1207e"))

from specserve.models.catalog import cache_root  # noqa: E402

from moe_model import decoding_engine  # noqa: E402

FILES = {n: cache_root() / "bench" / f"qwen35-35b-a3b-random-{n}l" / f"qwen35-35b-a3b-random-{n}l-q4_k_m.gguf"
         for n in (4, 8)}


def main() -> None:
    engines = {n: decoding_engine(max_model_len=1024, max_tokens=900, path=p)[1] for n, p in FILES.items()}
    times = {4: [], 8: []}
    for turn in range(8):
        for n in ((4, 8) if turn % 2 == 0 else (8, 4)):
            t0 = time.perf_counter()
            for _ in range(20):
                engines[n].step()
            times[n].append((time.perf_counter() - t0) / 20 * 1e3)
    for n in (4, 8):
        print(f"{n} layers: ms/step median {statistics.median(times[n]):.2f} (" +
              " ".join(f"{t:.2f}" for t in times[n]) + ")")
    diffs = [b - a for a, b in zip(times[4], times[8])]
    print(f"four layers (8-layer step less the 4-layer step of the same turn): median "
          f"{statistics.median(diffs):.2f} ms (" + " ".join(f"{d:.2f}" for d in diffs) + ")")
    print(f"the head and fixed costs (4-layer step less four layers): "
          f"{statistics.median(times[4]) - statistics.median(diffs):.2f} ms")


if __name__ == "__main__":
    main()
