"""A layer's experts in one mapping (huge pages) or each in its own (4 KiB pages), taking turns in one
process: the 4-layer Qwen3.5-35B-A3B-shaped model (hybrid_speed.py --model 35b-a3b --layers 4),
the MoE MLPs' time per decode step. The engine gives each expert's packed weights a mapping of its
own (under 2 MiB: 4 KiB pages, kernels/hostmem.py); here a copy of all of them side by side in one
mapping (64-byte aligned, huge pages advised) is made, and the two are swapped in turn (the same
bytes). Tried and not kept: README "Qwen3.5-MoE's shapes vs native llama.cpp".

    python results_final/zen4_1207d/moe_pages.py > results_final/zen4_1207d/moe_pages.txt
"""

import statistics
import time

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.kernels.hostmem import anon_bytes
from specserve.models import hybrid
from specserve.models.catalog import cache_root
from specserve.models.loader import load_model

GGUF = cache_root() / "bench" / "qwen35-35b-a3b-random-4l" / "qwen35-35b-a3b-random-4l-q4_k_m.gguf"


def main() -> None:
    m = load_model(str(GGUF))
    eng = LLMEngine(m, EngineConfig(max_model_len=512, max_num_seqs=2))
    eng.add_request("a", list(range(100, 116)), SamplingParams(max_tokens=400, ignore_eos=True))
    weights = [lin.weight for layer in m.model.layers for ex in layer.mlp.experts for lin in (ex.gate_up, ex.down)]
    apart = [w.packed for w in weights]  # each in its own mapping, as every weight under 2 MiB is
    sizes = [-(-p.numel() // 64) * 64 for p in apart]
    arena, at, together = anon_bytes(sum(sizes)), 0, []
    for p, size in zip(apart, sizes):
        arena[at:at + p.numel()].copy_(p)
        together.append(arena[at:at + p.numel()])
        at += size
    spent = [0.0]
    forward = hybrid.SparseMoE.forward

    def timed(self, h):
        t = time.perf_counter()
        out = forward(self, h)
        spent[0] += time.perf_counter() - t
        return out

    hybrid.SparseMoE.__call__ = timed
    for _ in range(10):
        eng.step()
    steps, runs = 20, {"one mapping": [], "one each": []}
    for _ in range(5):
        for name, packed in (("one mapping", together), ("one each", apart)):
            for w, p in zip(weights, packed):
                w.packed = p
            spent[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            runs[name].append((time.perf_counter() - t0, spent[0]))
    for name, rs in runs.items():
        print(f"experts {name}: decode step {statistics.median(r[0] for r in rs) / steps * 1e3:.2f} ms, MoE MLPs "
              f"{statistics.median(r[1] for r in rs) / steps * 1e3:.2f} ms (median of 5 turns of {steps} steps)")


if __name__ == "__main__":
    main()
