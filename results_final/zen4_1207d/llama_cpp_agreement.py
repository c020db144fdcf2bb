"""The tiny Qwen3.5-MoE GGUFs (tests/data/tiny_qwen35) against native llama-server's greedy tokens
(recorded by tests/data/make_tiny_qwen35.py): tokens equal before each prompt's paths part, and our
logit margin where they part. The F32 file in float32; llama-quantize's Q8_0 with the file's blocks
and the router and shared-expert gate in float32 (as loaded), then with those two in int8 (as before
fc076b6). README "Hybrid models".

    python results_final/zen4_1207d/llama_cpp_agreement.py > results_final/zen4_1207d/llama_cpp_agreement.txt
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests")]

from hybrid_utils import DATA, LLAMA_CPP, greedy_outputs, llama_cpp_partings, make_engine  # noqa: E402
from tiny_models import FP32  # noqa: E402

from specserve.kernels import ops  # noqa: E402
from specserve.models.layers import Linear  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402


def report(label: str, model, name: str) -> None:
    plain = [greedy_outputs(make_engine(model), [p], LLAMA_CPP["tokens"])[0] for p in LLAMA_CPP["prompts"]]
    same, partings = llama_cpp_partings(model, name, plain)
    total = sum(map(len, LLAMA_CPP["files"][name]))
    where = "; ".join(f"token {i}: margin {m:.4f} of max {t:.2f}" for i, _, _, _, m, t in partings)
    print(f"{label}: {same} of {total} tokens equal before the paths part; {where or 'no parting'}")


def int8_gates(model) -> None:
    for layer in model.model.layers:
        for attr in ("router", "shared_gate"):
            lin = getattr(layer.mlp, attr)
            setattr(layer.mlp, attr, Linear.of_weight(ops.Int8Weight.from_float(lin.float_weight()), None,
                                                      torch.device("cpu"), "int8"))


def main() -> None:
    report("tiny-qwen35moe-f32.gguf, float32", load_model(str(DATA / "tiny-qwen35moe-f32.gguf"), FP32),
           "tiny-qwen35moe-f32.gguf")
    q8 = load_model(str(DATA / "tiny-qwen35moe-q8_0.gguf"))
    report("tiny-qwen35moe-q8_0.gguf, float32 router and shared-expert gate", q8, "tiny-qwen35moe-q8_0.gguf")
    int8_gates(q8)
    report("tiny-qwen35moe-q8_0.gguf, int8 router and shared-expert gate", q8, "tiny-qwen35moe-q8_0.gguf")


if __name__ == "__main__":
    main()
