"""The Qwen3.5-0.8B-shaped model (hybrid_speed.py's Q4_K_M file, random weights) decoding one
request, its layers fused (one C call a forward, models/hybrid_fused.py) and on the per-op Python
path taking turns in one engine (the turns continue one sequence): ms per decode step, 8 turns
of 20 steps each way. (That both ways give the same bits is tests/test_hybrid_fused.py's.)

    python results_final/zen4_1208/fused_ab.py [GGUF] > results_final/zen4_1208/fused_ab.txt
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zen4_1207e"))

from specserve.models.catalog import cache_root  # noqa: E402

from moe_model import decoding_engine  # noqa: E402

GGUF = cache_root() / "bench" / "qwen35-0.8b-random" / "qwen35-0.8b-random-q4_k_m.gguf"


def main() -> None:
    m, eng = decoding_engine(max_model_len=1024, max_tokens=900, path=sys.argv[1] if len(sys.argv) > 1 else GGUF)
    times = {True: [], False: []}
    for turn in range(8):
        for fused in ((True, False) if turn % 2 == 0 else (False, True)):
            m.model.fused = fused
            t0 = time.perf_counter()
            for _ in range(20):
                eng.step()
            times[fused].append((time.perf_counter() - t0) / 20 * 1e3)
    for fused, label in ((False, "python path"), (True, "fused")):
        ts = times[fused]
        print(f"{label:12s} ms/step median {statistics.median(ts):6.2f}  all " + " ".join(f"{t:.2f}" for t in ts))
    pairs = [p / f for p, f in zip(times[False], times[True])]
    print(f"python / fused per turn: median {statistics.median(pairs):.3f} (" +
          " ".join(f"{r:.3f}" for r in pairs) + ")")


if __name__ == "__main__":
    main()
