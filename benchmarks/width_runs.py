"""The verification width over several runs of decode_cost.py: how t(M)/t(1) spreads on a shared machine.

    python benchmarks/width_runs.py RUN.json [RUN.json ...] [--goal 1.5] [--markdown width.md]

Each RUN.json is one ``decode_cost.py --out`` file (the same command run at different times). Per
model and row count M it prints the median forward time over the runs (ms, each run's own median)
with the runs' range, and the ratio t(M)/t(1) as each run measured it (both times from the same
run: the ratio is what speculation pays per step) as median and range, and in how many runs the
ratio stayed at or under --goal (the speed issue's 1.5 for 8 rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """median (min-max)"""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def collect(paths: list[str]) -> dict[tuple[str, str], list[dict]]:
    """(model, weights) -> one decode_cost result per run."""
    out: dict[tuple[str, str], list[dict]] = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["results"]:
                out.setdefault((r["model"], r["format"]), []).append(r)
    return out


def markdown(runs: dict[tuple[str, str], list[dict]], goal: float) -> str:
    rows = sorted({m for rs in runs.values() for r in rs for m in r["median_ms"]}, key=int)
    wide = [m for m in rows if m != "1"]
    head = (["model", "runs", "t(1) ms"] + [f"t({m}) ms" for m in wide] + [f"t({m})/t(1)" for m in wide]
            + [f"runs with t({m})/t(1) <= {goal}" for m in wide])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (model, _), rs in runs.items():
        cells = [model, str(len(rs)), spread([r["median_ms"]["1"] for r in rs])]
        cells += [spread([r["median_ms"][m] for r in rs]) for m in wide]
        ratios = {m: [r["median_ms"][m] / r["median_ms"]["1"] for r in rs] for m in wide}
        cells += [spread(ratios[m], "{:.2f}") for m in wide]
        cells += [f"{sum(x <= goal for x in ratios[m])}/{len(rs)}" for m in wide]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="decode_cost.py --out files")
    ap.add_argument("--goal", type=float, default=1.5)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    md = markdown(collect(a.runs), a.goal)
    print(md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
