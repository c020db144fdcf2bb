"""Teacher-forced agreement of the 4-bit qwen2.5-coder-0.5b draft with qwen2.5-coder-1.5b's greedy
answers: the code, math and prose suites' first four chat prompts, 96 greedy tokens each from the
1.5b, then one forward of the draft over prompt + answer, its argmax at each answer position
compared with the 1.5b's token (the share a one-token draft would have accepted). All 24 layers,
then with 2-8 layers left out (the per-op path; each layer keeps its weights).

    python results_final/zen4_1207c/draft_layers.py > results_final/zen4_1207c/draft_layers.txt
"""
import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402

import spec_decode as sd  # noqa: E402
from specserve.bench.suites import load_suites  # noqa: E402
from specserve.engine.model_runner import BatchEntry, build_forward_batch  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402
from specserve.models.transformer import KVCache  # noqa: E402


def answers() -> list[tuple[list[int], list[int]]]:
    ns = argparse.Namespace(quantization="auto", ctx=4096, threads=None)
    eng = sd.make_engines("qwen2.5-coder-1.5b", [("plain", None)], ns)["plain"]
    return [(ids, sd.run_one(eng, ids, 96)["tokens"]) for suite in ("code", "math", "prose")
            for _, _, ids in sd.chat_prompts(eng.tokenizer, load_suites(suite, 4))]


def agreement(model, layers, keep, seqs, kv) -> float:
    model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    ok = total = 0
    for ids, ans in seqs:
        toks = ids + ans
        tables = [list(range(-(-len(toks) // 16)))]
        batch = build_forward_batch([BatchEntry(toks, 0, tables)], 16, 128, list(range(len(ids) - 1, len(toks) - 1)),
                                    model.device)
        pred = model.forward(batch, kv).logits.argmax(-1).tolist()
        ok += sum(a == b for a, b in zip(pred, ans))
        total += len(ans)
    return ok / total


def main() -> None:
    seqs = answers()
    m = load_model("qwen2.5-coder-0.5b", LoadOptions("cpu", "auto", "q4_0")).model
    m.fused = False
    layers = list(m.layers)
    n = len(layers)
    kv = KVCache.allocate(m.cfg, 128, 16, m.dtype, m.device)
    print(f"all {n} layers: agreement {agreement(m, layers, list(range(n)), seqs, kv):.3f}", flush=True)
    for skip in (2, 4, 6, 8):
        for start in (n // 2 - skip // 2, n - 2 - skip, 4):
            keep = [i for i in range(n) if not start <= i < start + skip]
            print(f"layers {start}-{start + skip - 1} left out: {len(keep)} layers, agreement "
                  f"{agreement(m, layers, keep, seqs, kv):.3f}", flush=True)


if __name__ == "__main__":
    main()
