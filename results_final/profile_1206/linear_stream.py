"""How fast one decode step's linear layers stream their weights: every linear of the model called
in layer order on one row (the C kernel straight through ctypes, no Python module around it),
30 rounds; per role the MB, median ms and GB/s.

    python results_final/profile_1206/linear_stream.py [--model qwen2.5-coder-0.5b] [--quantization q4_0]

Weights far larger than the caches, so the rate is the memory's as the kernels read it.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from specserve.kernels import linear as L  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402


def roles(layer) -> list[tuple[str, object]]:
    mlp = layer.mlp
    out = [("qkv", layer.qkv)] if layer.qkv is not None else [("q", layer.q), ("k", layer.k), ("v", layer.v)]
    out += [("o", layer.o)]
    out += [("gate_up", mlp.gate_up)] if mlp.gate_up is not None else [("gate", mlp.gate), ("up", mlp.up)]
    return out + [("down", mlp.down)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    model = load_model(a.model, LoadOptions("cpu", "auto", a.quantization)).model
    lib = L._select(None)
    lins = [(n, lin) for layer in model.layers for n, lin in roles(layer)] + [("lm_head", model.lm_head)]
    calls, keep = [], []
    for name, lin in lins:
        w = lin.weight
        n, k = w.shape
        x, o = torch.randn(1, k), torch.empty(1, n)
        keep += [x, o]
        wptr, fmt, row_bytes, sptr = w._c_args()
        fn = lib.ss_linear if w.act_block is None else lib.ss_linear_q8
        args = (x.data_ptr(), 1, k, k, wptr, fmt, row_bytes, sptr, None, o.data_ptr(), n, n, a.threads)
        calls.append((f"{name}:{lin.format}", fn, args, lin.nbytes()))
    nbytes: dict[str, int] = {}
    for key, _, _, b in calls:
        nbytes[key] = nbytes.get(key, 0) + b
    per = {key: [] for key in nbytes}
    totals = []
    for _ in range(a.rounds):
        acc = dict.fromkeys(nbytes, 0.0)
        t0 = time.perf_counter()
        for key, fn, args, _ in calls:
            t = time.perf_counter()
            fn(*args)
            acc[key] += time.perf_counter() - t
        totals.append(time.perf_counter() - t0)
        for key, v in acc.items():
            per[key].append(v)
    total, med = sum(nbytes.values()), statistics.median(totals)
    print(f"{a.model} {a.quantization}, {a.threads} threads: {total / 1e6:.1f} MB of linears in {1e3 * med:.2f} ms "
          f"= {total / med / 1e9:.1f} GB/s")
    for key, b in nbytes.items():
        t = statistics.median(per[key])
        print(f"  {key:16s} {b / 1e6:7.1f} MB {1e3 * t:6.2f} ms {b / t / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
