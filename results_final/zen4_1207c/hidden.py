"""Final hidden states (after the final norm) of qwen2.5-coder-1.5b over real text: the code, math and
prose suites' first two chat prompts, each with its 96-token greedy answer, read in one forward.

    python results_final/zen4_1207c/hidden.py OUT.pt
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
from specserve.models.transformer import KVCache  # noqa: E402


def main() -> None:
    ns = argparse.Namespace(quantization="auto", ctx=4096, threads=None)
    eng = sd.make_engines("qwen2.5-coder-1.5b", [("plain", None)], ns)["plain"]
    m = eng.model
    kv = KVCache.allocate(m.cfg, 64, 16, m.dtype, m.device)
    hs = []
    for _, _, ids in sd.chat_prompts(eng.tokenizer, load_suites("code,math,prose", 2)):
        toks = (ids + sd.run_one(eng, ids, 96)["tokens"])[:1000]
        tables = [list(range(-(-len(toks) // 16)))]
        batch = build_forward_batch([BatchEntry(toks, 0, tables)], 16, 64, [], m.device)
        hs.append(m.forward(batch, kv).final_hidden)
    torch.save(torch.cat(hs), sys.argv[1])


if __name__ == "__main__":
    main()
