"""A decode step's time outside the model's forward: one request decoding, 100 steps, wall time per
engine step against the time inside ``model.forward`` (embedding, the fused layers, final norm, LM
head) and inside its layers alone (``run_layers``), for the Qwen3.5-0.8B-shaped Q4_K_M file and a
catalog model.

    python results_final/zen4_1208/step_overhead.py > results_final/zen4_1208/step_overhead.txt
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zen4_1207e"))

from specserve.models.catalog import cache_root  # noqa: E402

from moe_model import decoding_engine, timed  # noqa: E402

MODELS = {"qwen3.5-0.8b shapes q4_k_m": cache_root() / "bench" / "qwen35-0.8b-random" / "qwen35-0.8b-random-q4_k_m.gguf",
          "qwen2.5-coder-1.5b": None}  # None: the catalog model of that name


def main() -> None:
    for label, path in MODELS.items():
        m, eng = decoding_engine(max_model_len=1024, max_tokens=900, path=path or label)
        model, spent = m.model, {}
        model.forward = timed(spent, "forward", model.forward)
        model.run_layers = timed(spent, "layers", model.run_layers)
        model.logits = timed(spent, "logits (LM head)", model.logits)
        n = 100
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        step = (time.perf_counter() - t0) / n * 1e3
        f, lay, head = (spent[k] / n * 1e3 for k in ("forward", "layers", "logits (LM head)"))
        print(f"{label}: step {step:.2f} ms; forward {f:.2f} (layers {lay:.2f}, LM head {head:.2f}, "
              f"the rest of the forward {f - lay - head:.2f}); outside the forward {step - f:.2f} ms")
        del m, eng, model


if __name__ == "__main__":
    main()
