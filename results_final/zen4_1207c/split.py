"""With bounded_head.patch applied: one row's bounded-head pieces timed apart (median and mean ms over
every third hidden state saved by hidden.py), beside the full head's call.

    python results_final/zen4_1207c/split.py HIDDEN.pt
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
from specserve.models import bounded_head as bh  # noqa: E402

T: dict[str, list[float]] = {}


def tm(key, fn):
    t = time.perf_counter()
    out = fn()
    T.setdefault(key, []).append(time.perf_counter() - t)
    return out


def bound(b, xq, centre):
    p = xq @ b.basis
    perp = xq - p @ b.basis.T
    c = centre + p @ b.du.T
    radius = (b.perp * perp.norm(dim=1, keepdim=True) + b.du_norm * (perp @ b.basis).norm(dim=1, keepdim=True)
              + b.slack * xq.norm(dim=1, keepdim=True)) * bh.WIDEN
    cand = c + radius >= (c - radius).amax(dim=1, keepdim=True)
    return cand.any(dim=0).nonzero().flatten()


def main() -> None:
    ns = argparse.Namespace(quantization="auto", ctx=4096, threads=None)
    b = sd.make_engines("qwen2.5-coder-1.5b", [("plain", None)], ns)["plain"].runner.bounded
    hs, sizes = torch.load(sys.argv[1]), []
    for i in range(0, hs.shape[0], 3):
        h = hs[i:i + 1].contiguous()
        xq = tm("activations quantized (torch)", lambda: bh.quantized(h, b.block))
        centre = tm("Q4_K copy", lambda: ops.linear(h, b.approx, None))
        union = tm("interval bound (torch)", lambda: bound(b, xq, centre))
        sizes.append(int(union.numel()))
        w = tm("candidates' panels copied", lambda: b.head.panels(torch.unique(union // bh.PANEL)))
        tm("candidates' exact logits", lambda: ops.linear(h, w, None))
        tm("full Q6_K head", lambda: ops.linear(h, b.head, None))
    for key, v in T.items():
        print(f"{key:32s} median {1e3 * statistics.median(v):6.2f} ms  mean {1e3 * sum(v) / len(v):6.2f} ms")
    sizes.sort()
    print(f"candidates: median {sizes[len(sizes) // 2]}, mean {sum(sizes) / len(sizes):.0f}, p90 {sizes[int(.9 * len(sizes))]}, "
          f"max {sizes[-1]} of {b.head.n}")


if __name__ == "__main__":
    main()
