"""The CUDA path's torch ops run on the CPU: is greedy ngram decoding still identical to plain?

A diagnostic for the CUDA check's open lossless question (README "CUDA check"): the model's layers
are switched from the CPU kernels to the torch branches the CUDA path takes (64-row linear tiles,
torch RMSNorm, rope, act_mul and device_attention), weights and K/V optionally in
bf16, at a catalog model's real shapes with random weights (benchmarks/cuda_shapes.py). Plain and
ngram greedy are compared; where they part, the two runs' forwards are replayed and the first
differing position, layer and op are printed.

    python benchmarks/cuda_check.py --device cpu --make-shape-dir qwen2.5-coder-1.5b DIR
    python benchmarks/cuda_path_on_cpu.py DIR [--layers N] [--bf16]

2026-12-04, AMD EPYC Zen 4: identical at the full 28 layers, in float32 (532 s) and in bf16 (187 s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import cuda_check  # noqa: E402
import cuda_shapes as shapes  # noqa: E402
from specserve.models import device_attention, layers, transformer  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.train import data as tdata  # noqa: E402


def linear(self, x):
    w = self.weight if isinstance(self.weight, torch.Tensor) else self.float_weight()
    return layers.device_linear(x, w, self.bias)


def attention(q, k_cache, v_cache, block_tables, seq_ids, positions, scale, window, softcap, **_):
    return device_attention.paged_attention(q, k_cache, v_cache, block_tables, seq_ids, positions, scale, window,
                                            softcap)


def rope(self, x, positions):
    if x.shape[-1] != 2 * self.cos.shape[1]:
        raise SystemExit("a partial-rotary model: not covered here")
    return self.torch_rotate(x, positions)


def device_path(target, bf16: bool) -> None:
    """Switch target's layers to the CUDA path's torch ops (process-wide: a diagnostic's run)."""
    layers.Linear.forward = layers.Linear.__call__ = linear
    layers.Rope.forward = layers.Rope.__call__ = rope
    transformer.rms_norm, transformer.act_mul = layers.torch_rms_norm, layers.torch_act_mul
    transformer.paged_attention = attention
    target.model.fused = False
    if not bf16:
        return
    for m in target.model.modules():
        if isinstance(m, layers.Linear):
            m.weight = (m.weight if isinstance(m.weight, torch.Tensor) else m.float_weight()).to(torch.bfloat16)
            m.bias = None if m.bias is None else m.bias.to(torch.bfloat16)
    emb = target.model.token_embedding
    emb._table, emb._head, emb._rows = emb.table().to(torch.bfloat16), None, None
    target.model.dtype = torch.bfloat16
    import specserve.engine.config as econf

    econf.resolve_kv_dtype = lambda *a, **k: "bf16"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape_dir")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--work", default="/tmp/specserve-cuda-path-on-cpu")
    args = ap.parse_args()
    cuda_check.DEVICE["name"] = "cpu"
    ckpt = shapes.random_checkpoint(Path(args.shape_dir), Path(args.work) / "shape", args.layers)
    target = load_model(str(ckpt), LoadOptions(device="cpu", quantization="none"))
    device_path(target, args.bf16)
    ids = tdata.chat_prompt_ids(target, shapes.SHAPE_PROMPT)
    t0 = time.time()
    plain, plain_log = shapes.logged_greedy(target, ids, 128)
    spec, spec_log = shapes.logged_greedy(target, ids, 128, SpeculativeConfig("ngram", num_speculative_tokens=5))
    first = shapes.first_token_difference(plain, spec)
    print(f"identical: {plain == spec}, first difference: {first}, {time.time() - t0:.0f} s", flush=True)
    if first is not None:
        print(shapes.history_difference(target, plain_log, spec_log) or "no position differs in the replays")


if __name__ == "__main__":
    main()
