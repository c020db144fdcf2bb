"""Where one decode step of the Qwen3.5-0.8B-shaped model goes on the per-op Python path
(``fused = False``; hybrid_speed.py's Q4_K_M file, random weights): wall time around every linear, the DeltaNet kernel, paged attention, the norms
and the activations (each timed at its Python call, so the ctypes call and argument checks are
inside), and the rest of the step (Python glue, torch views and copies, sampling, bookkeeping).

    python results_final/zen4_1208/step_parts_08b.py > results_final/zen4_1208/step_parts_08b.txt
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zen4_1207e"))

from specserve.kernels import ops  # noqa: E402
from specserve.models import hybrid, transformer  # noqa: E402
from specserve.models import layers as L  # noqa: E402
from specserve.models.catalog import cache_root  # noqa: E402

from moe_model import decoding_engine, timed  # noqa: E402

GGUF = cache_root() / "bench" / "qwen35-0.8b-random" / "qwen35-0.8b-random-q4_k_m.gguf"


def steps_ms(eng, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        eng.step()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    m, eng = decoding_engine(max_model_len=1024, max_tokens=900, path=GGUF)
    m.model.fused = False
    plain = [steps_ms(eng, 20) for _ in range(5)]
    spent: dict = {}
    patches = [(L.Linear, "__call__", "linear"), (ops, "gated_delta", "deltanet kernel"),
               (hybrid, "attend", "attention (KV write + paged)"), (hybrid, "rms_norm", "rms_norm"),
               (transformer, "act_mul", "act_mul (MLP)"), (hybrid, "act_mul", "act_mul (DeltaNet gate)"),
               (ops, "sigmoid_mul", "sigmoid_mul")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, label in patches:
        setattr(obj, name, timed(spent, label, getattr(obj, name)))
    n = 100
    total = steps_ms(eng, n)
    for obj, name, fn in saved:
        setattr(obj, name, fn)
    after = [steps_ms(eng, 20) for _ in range(5)]
    print(f"decode step without timers, median of 5 x 20 steps: before {sorted(plain)[2]:.2f} ms, "
          f"after {sorted(after)[2]:.2f} ms")
    print(f"with timers, {n} steps: {total:.2f} ms a step")
    for label, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {label:32s} {s / n * 1e3:7.2f} ms")
    print(f"  {'rest of the step':32s} {total - sum(spent.values()) / n * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
