"""Huge pages against 4 KiB pages for the packed weights, in one process.

    python benchmarks/host_pages.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--rows 1,8]
        [--contexts 512,2048] [--rounds 30] [--markdown pages.md]

specserve allocates the packed weights in mappings advised MADV_HUGEPAGE
(specserve/kernels/hostmem.py). Each model is loaded twice: one copy as loaded, the other with
every packed weight copied into torch's own allocation (4 KiB pages); both read one KV cache.
One forward of M rows after --context cached tokens (decode_cost.py's "verify" shape,
fused path) is timed for both, the copies taking turns in every round, and the median per case is
reported with the ratio huge / 4 KiB (below 1: huge pages faster). First the same for one Q4_K
linear of 113 MB over random blocks, alone. The bits are the same: only
where the bytes live differs (checked: both copies' logits are compared once).

The "huge MB" column is how much of the loaded copy's packed weights the OS actually backed with
huge pages (AnonHugePages in /proc/self/smaps); 0 where transparent huge pages are off
(/sys/kernel/mm/transparent_hugepage/enabled "never").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from decode_cost import BLOCK, filled_cache, make_batch  # noqa: E402
from specserve.engine.builder import set_threads  # noqa: E402
from specserve.models.layers import linears  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402


def packed_weights(model) -> list:
    return [lin.weight for lin in linears(model) if getattr(lin.weight, "packed", None) is not None]


def to_small_pages(model) -> None:
    """Every packed weight copied into torch's allocation (before the first forward builds the
    fused descriptors, which hold the pointers)."""
    for w in packed_weights(model):
        w.packed = w.packed.clone()


def huge_mb(tensors: list[torch.Tensor]) -> tuple[float, float]:
    """(MB of the mappings holding ``tensors`` that the OS backs with huge pages, MB of the tensors)."""
    maps, cur = [], None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) >= 5:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    cur = [lo, hi, 0]
                    maps.append(cur)
                elif head[0] == "AnonHugePages:" and cur is not None:
                    cur[2] = int(head[1]) * 1024
    except OSError:
        return 0.0, sum(t.numel() * t.element_size() for t in tensors) / 1e6
    hit = {(lo, hi): huge for lo, hi, huge in maps for t in tensors if lo <= t.data_ptr() < hi}
    total = sum(t.numel() * t.element_size() for t in tensors)
    return min(sum(hit.values()), total) / 1e6, total / 1e6  # (a mapping is its tensor plus alignment)


def synthetic(a: argparse.Namespace) -> list[dict]:
    """One Q4_K linear of 131072 x 1536 (113 MB, streamed from memory), both ways, taking turns."""
    from specserve.kernels.linear import linear
    from specserve.kernels.tune import random_block_weight

    ws = {"huge": random_block_weight("Q4_K", 131072, 1536), "4k": random_block_weight("Q4_K", 131072, 1536)}
    ws["4k"].packed = ws["4k"].packed.clone()
    got, total = huge_mb([ws["huge"].packed])
    out = []
    for m in (int(x) for x in a.rows.split(",")):
        x = torch.randn(m, 1536)
        times = {p: [] for p in ws}
        for r in range(a.rounds + 2):
            for p in (("huge", "4k") if r % 2 else ("4k", "huge")):
                t0 = time.perf_counter()
                linear(x, ws[p])
                if r >= 2:
                    times[p].append(time.perf_counter() - t0)
        t4, th = (statistics.median(times[p]) * 1e3 for p in ("4k", "huge"))
        out.append({"model": "Q4_K linear 131072x1536", "context": "-", "rows": m, "ms_4k": t4, "ms_huge": th,
                    "ratio": th / t4, "huge_mb": got, "weights_mb": total, "same_logits": "-"})
        print(f"[synthetic] M={m}: 4 KiB {t4:.2f} ms, huge {th:.2f} ms ({th / t4:.3f})", file=sys.stderr, flush=True)
    return out


def measure(name: str, a: argparse.Namespace) -> list[dict]:
    rows = [int(x) for x in a.rows.split(",")]
    ctxs = [int(x) for x in a.contexts.split(",")]
    opts = LoadOptions("cpu", "auto", "auto")
    small = load_model(name, opts)  # first: a later load may get memory the first one freed
    to_small_pages(small.model)
    huge = load_model(name, opts)
    cfg = huge.config
    got, total = huge_mb([w.packed for w in packed_weights(huge.model)])
    out = []
    for ctx in ctxs:
        bps = -(-(ctx + max(rows)) // BLOCK)
        kv = filled_cache(cfg, bps, "fp32")
        models = {"huge": huge.model, "4k": small.model}
        batches = {m: make_batch(m, ctx, "verify", bps, cfg.vocab_size) for m in rows}
        times = {(p, m): [] for p in models for m in rows}
        with torch.inference_mode():
            same = torch.equal(*(models[p].forward(batches[rows[-1]], kv).logits for p in models))
            for r in range(a.rounds + 2):
                for p in (("huge", "4k") if r % 2 else ("4k", "huge")):
                    for m in rows:
                        t0 = time.perf_counter()
                        models[p].forward(batches[m], kv)
                        if r >= 2:  # two warm-up rounds
                            times[(p, m)].append(time.perf_counter() - t0)
        for m in rows:
            t4, th = (statistics.median(times[(p, m)]) * 1e3 for p in ("4k", "huge"))
            out.append({"model": name, "context": ctx, "rows": m, "ms_4k": t4, "ms_huge": th, "ratio": th / t4,
                        "huge_mb": got, "weights_mb": total, "same_logits": same})
            print(f"[{name}] ctx {ctx} M={m}: 4 KiB {t4:.1f} ms, huge {th:.1f} ms ({th / t4:.3f}); "
                  f"{got:.0f} of {total:.0f} MB in huge pages; same logits: {same}", file=sys.stderr, flush=True)
    return out


def markdown(res: list[dict], threads: int) -> str:
    lines = [f"One forward (fused path, {threads} threads), ms, median; ratio = huge / 4 KiB pages.", "",
             "| model | context | M | 4 KiB pages | huge pages | ratio | weights in huge pages (MB) | same logits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res:
        lines.append(f"| {r['model']} | {r['context']} | {r['rows']} | {r['ms_4k']:.2f} | {r['ms_huge']:.2f} | "
                     f"{r['ratio']:.3f} | {r['huge_mb']:.0f} of {r['weights_mb']:.0f} | {r['same_logits']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    threads = set_threads(a.threads)
    res = synthetic(a) + [r for name in a.models.split(",") for r in measure(name.strip(), a)]
    md = markdown(res, threads)
    print(md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
