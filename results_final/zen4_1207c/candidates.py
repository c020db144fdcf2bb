"""How many LM-head rows could still be the argmax after a cheaper copy of the head and an interval
bound (bounded_head.patch's module docstring), for qwen2.5-coder-1.5b's Q6_K head, in float64 from
the dequantized GGUF tensors, over hidden states saved by hidden.py (every 7th row).

    python results_final/zen4_1207c/candidates.py HIDDEN.pt

Copies: the file's own Q4_K token table (the model ties them) and a Q4_0 re-quantization of the head.
Bounds: Cauchy-Schwarz alone, and a rank-r correction along directions U: from the hidden states'
principal directions (fitted on the even rows, counted on the odd ones: the same six answers, so
optimistic), from the head's or the difference's own Gram matrix, or the r axes where |h| is largest.
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from specserve.models.catalog import resolve_model  # noqa: E402


def deq(t) -> torch.Tensor:
    return torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1, int(t.shape[0])))


def q4_0(w: torch.Tensor) -> torch.Tensor:  # ggml's Q4_0: per 32 values, d = max / -8, q in 0..15
    b = w.reshape(w.shape[0], -1, 32)
    mx = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))
    d = mx / -8
    q = torch.clamp(torch.round(b / torch.where(d == 0, torch.ones_like(d), d)) + 8, 0, 15)
    return ((q - 8) * d).reshape(w.shape)


def count(e, a, h, basis=None) -> str:
    d = e - a
    if basis is None:
        du, perp = None, d.norm(dim=1)
    else:
        du = d @ basis
        perp = (d - du @ basis.T).norm(dim=1)
    n = []
    for x in h:
        c = a @ x
        if basis is None:
            r = perp * x.norm()
        else:
            p = basis.T @ x
            c = c + du @ p
            r = perp * (x - basis @ p).norm()
        n.append(int((c + r >= (c - r).max()).sum()))
    n.sort()
    return (f"median {statistics.median(n):7.0f}  mean {sum(n) / len(n):8.0f}  p90 {n[int(.9 * len(n))]:7d}  "
            f"max {n[-1]:7d}")


def main() -> None:
    tensors = {t.name: t for t in gguf.GGUFReader(str(resolve_model("qwen2.5-coder-1.5b").path)).tensors}
    e = deq(tensors["output.weight"])
    h = torch.load(sys.argv[1]).double()
    train, test = h[0::2], h[1::2][::7]
    print(f"{e.shape[0]} rows; {test.shape[0]} hidden states counted; ||h|| median {h.norm(dim=1).median():.1f}")
    pca = torch.linalg.svd(train, full_matrices=False).Vh.T
    for name, a in (("Q4_K token table", deq(tensors["token_embd.weight"])), ("Q4_0 of the head", q4_0(e))):
        d = e - a
        gram_d = torch.linalg.eigh(d.T @ d).eigenvectors.flip(-1)
        gram_e = torch.linalg.eigh(e.T @ e).eigenvectors.flip(-1)
        axes = train.abs().mean(0).argsort(descending=True)
        print(f"{name}: ||E_i - A_i|| median {d.norm(dim=1).median():.4f}")
        print(f"  Cauchy-Schwarz             {count(e, a, test)}")
        for r in (8, 16, 32, 128):
            print(f"  hidden-state PCA r={r:<4}     {count(e, a, test, pca[:, :r].contiguous())}")
        for r in (32,):
            print(f"  Gram of E - A r={r:<4}      {count(e, a, test, gram_d[:, :r].contiguous())}")
            print(f"  Gram of E r={r:<4}          {count(e, a, test, gram_e[:, :r].contiguous())}")
            print(f"  largest |h| axes r={r:<4}   {count(e, a, test, torch.eye(e.shape[1], dtype=torch.float64)[:, axes[:r]])}")


if __name__ == "__main__":
    main()
