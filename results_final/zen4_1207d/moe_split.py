"""Where a decode step of the 4-layer Qwen3.5-35B-A3B-shaped model goes (hybrid_speed.py --model 35b-a3b
--layers 4 made the file): timers around the LM head, the layers and their mixture-of-experts MLPs,
with a layer's experts in one kernel call (kernels/grouped.py) and one call each, taking turns; and
one MoE layer's parts with its inputs fixed (weights then partly in cache). ms, 2 threads.

    python results_final/zen4_1207d/moe_split.py > results_final/zen4_1207d/moe_split.txt
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models import hybrid
from specserve.models.catalog import cache_root
from specserve.models.layers import route_top_k
from specserve.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from weight_stream import timed as median_time  # noqa: E402  (the median of rounds after a warm-up call)

GGUF = cache_root() / "bench" / "qwen35-35b-a3b-random-4l" / "qwen35-35b-a3b-random-4l-q4_k_m.gguf"
spent: dict[str, float] = {}


def timed(label, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        return out
    return wrapper


def main() -> None:
    m = load_model(str(GGUF))
    eng = LLMEngine(m, EngineConfig(max_model_len=512, max_num_seqs=2))
    eng.add_request("a", list(range(100, 116)), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(10):
        eng.step()
    model = m.model
    model.logits = timed("LM head", model.logits)
    model.run_layers = timed("layers", model.run_layers)
    hybrid.SparseMoE.__call__ = timed("MoE MLPs", hybrid.SparseMoE.forward)
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, hybrid.SparseMoE)]
    steps, runs = 20, {True: [], False: []}
    for _ in range(4):  # the experts in one kernel call a layer, or one call each: taking turns
        for grouped in (True, False):
            for mlp in moes:
                mlp._groupable = grouped and None
            spent.clear()
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            runs[grouped].append({"step": time.perf_counter() - t0, **spent})
    for grouped, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) / steps * 1e3 for k in rs[0]}
        print(f"experts {'grouped' if grouped else 'one by one'}: decode step {med.pop('step'):.2f} ms; per step "
              "(median of 4 turns of 20 steps): " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    mlp, x = model.layers[0].mlp, torch.randn(1, m.config.hidden_size)

    def ms(f):
        return median_time(f, 300) * 1e3

    logits = mlp.router(x)
    _, groups = route_top_k(logits, 8, True)
    e = mlp.experts[groups[0][0]]
    print(f"one MoE layer, the same input each time: {ms(lambda: mlp.forward(x)):.3f} ms; router "
          f"{ms(lambda: mlp.router(x)):.3f}, routing {ms(lambda: route_top_k(logits, 8, True)):.3f}, one expert "
          f"{ms(lambda: e(x)):.3f} (its gate|up {ms(lambda: e.gate_up(x)):.3f}), the shared expert "
          f"{ms(lambda: mlp.shared(x)):.3f}")


if __name__ == "__main__":
    main()
