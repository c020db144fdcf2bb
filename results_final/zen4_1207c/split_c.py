"""With bounded_head_c.patch applied: one row's bounded-head pieces timed apart (median and mean ms
over every second hidden state saved by hidden.py), beside the full head's call, and every row's
token checked against the full head's argmax.

    python results_final/zen4_1207c/split_c.py HIDDEN.pt
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402

import spec_decode as sd  # noqa: E402
from specserve.kernels import ops  # noqa: E402
from specserve.kernels.head_bound import head_candidates, quantized_rows  # noqa: E402

T: dict[str, list[float]] = {}


def tm(key, fn):
    t = time.perf_counter()
    out = fn()
    T.setdefault(key, []).append(time.perf_counter() - t)
    return out


def project(b, xq):
    p = xq @ b.basis
    perp = xq - p @ b.basis.T
    return p, torch.stack([perp.norm(dim=1), (perp @ b.basis).norm(dim=1), xq.norm(dim=1), p.norm(dim=1)], dim=1)


def main() -> None:
    ns = argparse.Namespace(quantization="auto", ctx=4096, threads=None)
    b = sd.make_engines("qwen2.5-coder-1.5b", [("plain", None)], ns)["plain"].runner.bounded
    hs, sizes, wrong = torch.load(sys.argv[1]), [], 0
    for i in range(0, hs.shape[0], 2):
        h = hs[i:i + 1].contiguous()
        wrong += b.tokens(h) != ops.linear(h, b.head, None).argmax(dim=1).tolist()
        xq = tm("activations quantized (C)", lambda: quantized_rows(h, b.head))
        p, s = tm("projections (torch)", lambda: project(b, xq))
        a = tm("Q4_K copy", lambda: ops.linear(h, b.approx, None))
        cand = tm("interval bound (C)", lambda: head_candidates(a, b.q, b.scale, b.coef, p, s))
        if cand is None:
            continue
        sizes.append(int(cand[0].numel()))
        w = tm("candidates' panels copied", lambda: b.head.panels(torch.unique(cand[0] // 16)))
        tm("candidates' exact logits", lambda: ops.linear(h, w, None))
        tm("full Q6_K head", lambda: ops.linear(h, b.head, None))
    for key, v in T.items():
        print(f"{key:32s} median {1e3 * statistics.median(v):6.2f} ms  mean {1e3 * sum(v) / len(v):6.2f} ms")
    sizes.sort()
    print(f"candidates: median {sizes[len(sizes) // 2]}, mean {sum(sizes) / len(sizes):.0f}, p90 "
          f"{sizes[int(.9 * len(sizes))]}, max {sizes[-1]} of {b.head.n}; tokens different from the full head's: "
          f"{wrong} of {len(range(0, hs.shape[0], 2))}")


if __name__ == "__main__":
    main()
