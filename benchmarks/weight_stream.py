"""How fast one-row linears read their weights, against what the machine reads at all.

    python benchmarks/weight_stream.py [--model qwen2.5-coder-1.5b] [--prefetch 2048,16384,65536]
        [--rounds 30] [--markdown out.md]

Prints GB/s (weight bytes over median time, 2 threads) for:
- a plain read: torch's sum over a 1 GiB float32 buffer (what memory gives a vectorized loop);
- one-row Q4_K and Q6_K linears over random blocks, cache-resident (a few MB) and streamed from
  memory (over 100 MB), with the build's kernels;
- every linear of ``--model`` called once per round with one row (its decode-time weight reads);
- with ``--prefetch``: that model pass with kernel builds compiled for each software prefetch
  distance (``-DQP_PF_BYTES``), the builds taking turns in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from specserve.engine.builder import set_threads  # noqa: E402
from specserve.kernels import build as kbuild  # noqa: E402
from specserve.kernels import library  # noqa: E402
from specserve.kernels.linear import linear  # noqa: E402
from specserve.kernels.tune import random_block_weight  # noqa: E402

BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}  # per 256 values


def timed(fn, rounds: int) -> float:
    fn()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def synthetic(rounds: int) -> list[tuple[str, float]]:
    buf = torch.ones(1 << 28)  # 1 GiB
    rows = [("plain read, torch sum over 1 GiB", buf.numel() * 4 / timed(buf.sum, rounds) / 1e9)]
    del buf
    for qtype, bb in BLOCK_BYTES.items():
        for n, where in ((8192, "cache-resident"), (131072, "streamed")):
            w, x = random_block_weight(qtype, n, 1536), torch.randn(1, 1536)
            nbytes = n * 1536 // 256 * bb
            rows.append((f"{qtype} 1 row, {n}x1536 ({nbytes / 1e6:.0f} MB, {where})",
                         nbytes / timed(lambda: linear(x, w), rounds) / 1e9))
    return rows


def model_pass(name: str):
    from specserve.models.layers import linears
    from specserve.models.loader import LoadOptions, load_model

    lm = load_model(name, LoadOptions("cpu", "auto", "auto"))
    lins = linears(lm.model)
    xs = {lin.in_features: torch.randn(1, lin.in_features) for lin in lins}
    nbytes = sum(lin.nbytes() for lin in lins)

    def run() -> None:
        for lin in lins:
            lin(xs[lin.in_features])

    return run, nbytes, lm


def prefetch_builds(distances: list[str]) -> dict[str, object]:
    """One kernel library per prefetch distance (the native build with -DQP_PF_BYTES=d)."""
    libs, saved = {}, os.environ.get("SPECSERVE_KERNEL_CFLAGS")
    try:
        for d in distances:
            os.environ["SPECSERVE_KERNEL_CFLAGS"] = f"-DQP_PF_BYTES={d}"
            res = kbuild.build(library.chosen_build()["variant"])
            if res.lib is None:
                raise SystemExit(f"kernel build with -DQP_PF_BYTES={d} failed: {res.error}")
            libs[d] = library._declare(res.lib)
    finally:
        if saved is None:
            os.environ.pop("SPECSERVE_KERNEL_CFLAGS", None)
        else:
            os.environ["SPECSERVE_KERNEL_CFLAGS"] = saved
    return libs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prefetch", default="", help="comma list of prefetch distances in bytes to compare")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    set_threads(2)
    rows = synthetic(a.rounds)
    run, nbytes, _lm = model_pass(a.model)
    rows.append((f"{a.model}: every linear, 1 row ({nbytes / 1e6:.0f} MB)", nbytes / timed(run, a.rounds) / 1e9))
    if a.prefetch:
        libs = prefetch_builds(a.prefetch.split(","))
        variant = library.chosen_build()["variant"]
        own = library._lib_cache.get(variant)
        times = {d: [] for d in libs}
        try:
            for r in range(a.rounds):
                order = list(libs)[r % len(libs):] + list(libs)[:r % len(libs)]
                for d in order:
                    library._lib_cache[variant] = libs[d]
                    t0 = time.perf_counter()
                    run()
                    times[d].append(time.perf_counter() - t0)
        finally:
            library._lib_cache[variant] = own
        for d, ts in times.items():
            rows.append((f"{a.model}: every linear, prefetch {d} B ahead", nbytes / statistics.median(ts) / 1e9))
    out = "| what | GB/s (median) |\n|---|---|\n" + "".join(f"| {w} | {g:.1f} |\n" for w, g in rows)
    print(out)
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(out)


if __name__ == "__main__":
    main()
