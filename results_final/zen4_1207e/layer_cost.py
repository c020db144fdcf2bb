"""What four layers cost each engine: Qwen3.5-35B-A3B's shapes (random weights) with its first 4
and first 8 layers (hybrid_speed.py --model 35b-a3b --layers 4 / 8; each four are three Gated
DeltaNet layers and a gated-attention one, each with its MoE MLP), decode of 64 tokens after a
16-token prompt. The 8-layer time less the 4-layer time is four layers; the 4-layer time less that
is the LM head and the step's fixed costs. (A 2-layer file has no attention layer, which
llama.cpp refuses.) Native llama.cpp (llama-bench tg64, 2 threads) and ours (the engine's
step loop) take turns, 5 turns.

    python results_final/zen4_1207e/layer_cost.py > results_final/zen4_1207e/layer_cost.txt
"""

import statistics
import sys
import time
from pathlib import Path

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models.catalog import cache_root
from specserve.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from native_llamacpp import build_native, llama_bench_rows  # noqa: E402

TURNS = 5
FILES = {n: cache_root() / "bench" / f"qwen35-35b-a3b-random-{n}l" / f"qwen35-35b-a3b-random-{n}l-q4_k_m.gguf"
         for n in (4, 8)}


def ours(eng: LLMEngine, tag: str, n: int = 64) -> float:
    """ms per decoded token, after the first."""
    t0 = None
    for i, _ in enumerate(eng.generate(list(range(100, 116)), SamplingParams(max_tokens=n + 1, ignore_eos=True),
                                       request_id=tag)):
        if i == 0:
            t0 = time.perf_counter()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    bench = build_native() / "llama-bench"
    engines = {n: LLMEngine(load_model(str(f)), EngineConfig(max_model_len=512, max_num_seqs=2)) for n, f in FILES.items()}
    ms = {(who, n): [] for who in ("llama.cpp", "specserve") for n in FILES}
    for turn in range(TURNS):
        for n, f in FILES.items():
            row = llama_bench_rows(bench, f, "-p", "0", "-n", "64")[0]
            ms[("llama.cpp", n)].append(1e3 / row["avg_ts"])
            ours(engines[n], f"w{turn}", 8)  # warm
            ms[("specserve", n)].append(ours(engines[n], f"t{turn}"))
    print(f"ms per token ({TURNS} turns; median)")
    med = {}
    for (who, n), v in ms.items():
        med[(who, n)] = statistics.median(v)
        print(f"  {who:10s} {n} layers: " + ", ".join(f"{x:.2f}" for x in v) + f"; median {med[(who, n)]:.2f}")
    four = {who: med[(who, 8)] - med[(who, 4)] for who in ("llama.cpp", "specserve")}
    for who, v in four.items():
        print(f"{who}: layers 4-7 (three DeltaNet, one attention, four MoE MLPs) {v:.2f} ms; "
              f"the head and fixed costs {med[(who, 4)] - v:.2f} ms")
    print(f"specserve / llama.cpp time: four layers {four['specserve'] / four['llama.cpp']:.2f}, "
          f"the rest {(med[('specserve', 4)] - four['specserve']) / (med[('llama.cpp', 4)] - four['llama.cpp']):.2f}, "
          f"8-layer step {med[('specserve', 8)] / med[('llama.cpp', 8)]:.2f}, 4-layer step "
          f"{med[('specserve', 4)] / med[('llama.cpp', 4)]:.2f}; 40 layers extrapolated "
          f"{(med[('specserve', 4)] + 9 * four['specserve']) / (med[('llama.cpp', 4)] + 9 * four['llama.cpp']):.2f}")


if __name__ == "__main__":
    main()
