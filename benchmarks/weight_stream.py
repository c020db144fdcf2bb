"""How fast one-row linears read their weights, against what the machine reads at all.

    python benchmarks/weight_stream.py [--model qwen2.5-coder-1.5b] [--prefetch 2048,16384,65536]
        [--variants 'label=cflags;...'] [--rounds 30] [--markdown out.md]

Prints GB/s (weight bytes over median time, 2 threads) for:
- a plain read: torch's sum over a 1 GiB float32 buffer (what memory gives a vectorized loop);
- one-row Q4_K and Q6_K linears over random blocks, cache-resident (a few MB) and streamed from
  memory (over 100 MB), with the build's kernels;
- every linear of ``--model`` called once per round with one row (its decode-time weight reads);
- with ``--prefetch`` or ``--variants``: the model pass and the synthetic linears again with kernel
  builds compiled with other flags (``--prefetch d`` is ``-DQP_PF_BYTES=d``), the builds taking turns
  in one process.
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


def synthetic_cases() -> list[tuple[str, object, int]]:
    """(what, call, weight bytes): one-row Q4_K and Q6_K linears over random blocks, cache-resident
    and streamed from memory."""
    cases = []
    for qtype, bb in BLOCK_BYTES.items():
        for n, where in ((8192, "cache-resident"), (131072, "streamed")):
            w, x = random_block_weight(qtype, n, 1536), torch.randn(1, 1536)
            nbytes = n * 1536 // 256 * bb
            cases.append((f"{qtype} 1 row, {n}x1536 ({nbytes / 1e6:.0f} MB, {where})",
                          (lambda w=w, x=x: linear(x, w)), nbytes))
    return cases


def synthetic(rounds: int) -> list[tuple[str, float]]:
    buf = torch.ones(1 << 28)  # 1 GiB
    rows = [("plain read, torch sum over 1 GiB", buf.numel() * 4 / timed(buf.sum, rounds) / 1e9)]
    del buf
    return rows + [(what, nbytes / timed(fn, rounds) / 1e9) for what, fn, nbytes in synthetic_cases()]


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


def variant_rows(a, libs: dict[str, object], run, model_bytes: int) -> list[tuple[str, float]]:
    """Every case of synthetic() and the model pass, per build, the builds taking turns each round."""
    cases = [(f"{a.model}: every linear, 1 row ({model_bytes / 1e6:.0f} MB)", run, model_bytes)]
    cases += synthetic_cases()
    times = {(label, c): [] for label in libs for c in range(len(cases))}
    for r in range(a.rounds):
        order = list(libs)[r % len(libs):] + list(libs)[:r % len(libs)]
        for label in order:
            with library.using(libs[label]):
                for c, (_, fn, nbytes) in enumerate(cases):
                    calls = max(1, int(2e8 // nbytes))  # short calls repeated: a single one times thread wake-up
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times[(label, c)].append((time.perf_counter() - t0) / calls)
    return [(f"{what}, {label}", nbytes / statistics.median(times[(label, c)]) / 1e9)
            for c, (what, _, nbytes) in enumerate(cases) for label in libs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prefetch", default="", help="comma list of prefetch distances in bytes to compare")
    ap.add_argument("--variants", default="", help="builds to compare, 'label=cflags;label=cflags' "
                    "(e.g. 'pairs=-DQP_SINGLE_ROWS=0;single=')")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    set_threads(2)
    rows = synthetic(a.rounds)
    run, nbytes, _lm = model_pass(a.model)
    rows.append((f"{a.model}: every linear, 1 row ({nbytes / 1e6:.0f} MB)", nbytes / timed(run, a.rounds) / 1e9))
    flag_sets = {f"prefetch {d} B ahead": f"-DQP_PF_BYTES={d}" for d in a.prefetch.split(",") if d}
    flag_sets.update(dict(v.split("=", 1) for v in a.variants.split(";") if v))
    if flag_sets:
        libs = {label: library.build_with_flags(flags) for label, flags in flag_sets.items()}
        rows += variant_rows(a, libs, run, nbytes)
    out = "| what | GB/s (median) |\n|---|---|\n" + "".join(f"| {w} | {g:.1f} |\n" for w, g in rows)
    print(out)
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(out)


if __name__ == "__main__":
    main()
