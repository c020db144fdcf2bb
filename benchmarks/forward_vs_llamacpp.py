"""One forward against native llama.cpp's, process by process, taking turns: 1 row and M rows.

    python benchmarks/forward_vs_llamacpp.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--rows 1,8]
        [--context 512] [--rounds 4] [--llama-pages huge|4k] [--out r.json] [--markdown r.md]

The one-token forward is plain decode's cost; the M-row forward is a verification's (M - 1 drafts).
Per round and model, in turn (the order flips every round):
- llama.cpp: ``llama-bench -t 2 -fa 1 -d CONTEXT -n 32 -p M`` (built from the llama-cpp-python
  sdist like ``native_llamacpp.py``; by default under ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, so
  its repacked weights get huge pages as ours do; ``--llama-pages 4k``: without): generation at
  CONTEXT tokens of depth gives ms per token, and a prompt of M tokens at that depth gives the M-row
  forward (``-p 1`` is not reported: the one-token forward is ``-n``'s);
- specserve: ``decode_cost.py --rows 1,M --context CONTEXT --formats auto`` in its own process
  (one sequence with M new tokens after CONTEXT cached ones, logits for every row).
Each engine is a fresh process per round: this machine's memory speed differs between processes
by 20-30%, so a ratio from one pair of processes is noise; the table gives every round's ratio
and the median. "ours / llama.cpp" above 1 means we are faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from native_llamacpp import (HUGE_PAGES_ENV, ISA_ENV, ISA_FLAGS, build_native, gguf_of,  # noqa: E402
                             llama_bench_rows)
from specserve.lock.fingerprint import cpu_info  # noqa: E402


def llama_bench(bench: Path, gguf: Path, rows: list[int], context: int, huge: bool = True) -> dict[int, float]:
    """ms per forward of M rows at CONTEXT tokens of depth, M = 1 from generation; huge: its weights
    in huge pages (HUGE_PAGES_ENV), as ours are."""
    wide = [m for m in rows if m > 1]
    out = {}
    for r in llama_bench_rows(bench, gguf, "-fa", "1", "-d", str(context), "-n", "32", "-p",
                              ",".join(map(str, wide)) if wide else "0", env=HUGE_PAGES_ENV if huge else None):
        if r["n_gen"]:
            out[1] = 1000.0 / r["avg_ts"]
        elif r["n_prompt"] in wide:
            out[r["n_prompt"]] = 1000.0 * r["n_prompt"] / r["avg_ts"]
    return out


def ours(model: str, rows: list[int], context: int, min_time: float, isa: str = "native") -> dict[int, float]:
    """decode_cost.py's median ms per forward, in its own process, with our kernel build for ISA."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        subprocess.run([sys.executable, str(HERE / "decode_cost.py"), "--models", model, "--formats", "auto",
                        "--rows", ",".join(map(str, rows)), "--context", str(context), "--min-time", str(min_time),
                        "--out", str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, **ISA_ENV[isa]})
        r = json.loads(out.read_text())["results"][0]
    return {int(m): v for m, v in r["median_ms"].items()}


def markdown(runs: list[dict], rows: list[int], context: int, huge: bool = True, isa: str = "native") -> str:
    wide = max(rows)
    pages = "huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)" if huge else "4 KiB pages"
    builds = "" if isa == "native" else f"both engines built for {isa} alone; "
    head = (f"ms per forward at {context} tokens of context, 2 threads, {builds}llama-bench's weights in {pages}; "
            f"ratio = llama.cpp / ours "
            f"(above 1: we are faster); t({wide})/t(1) per engine\n\n"
            f"| model | round | llama.cpp 1 row | ours 1 row | ratio | llama.cpp {wide} rows | ours {wide} rows "
            f"| ratio | t({wide})/t(1) llama.cpp | t({wide})/t(1) ours |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [r for r in runs if r["model"] == model]
        for r in mine:
            lines.append(row_cells(model, str(r["round"]), r["llama"], r["ours"], wide))
        med = {side: {m: statistics.median(r[side][m] for r in mine) for m in rows} for side in ("llama", "ours")}
        ratios = [r["llama"][1] / r["ours"][1] for r in mine]
        wide_ratios = [r["llama"][wide] / r["ours"][wide] for r in mine]
        lines.append(row_cells(f"**{model}**", "median", med["llama"], med["ours"], wide,
                               f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                               f"{statistics.median(wide_ratios):.2f} ({min(wide_ratios):.2f}-{max(wide_ratios):.2f})"))
    return head + "".join(lines)


def row_cells(model: str, rnd: str, lc: dict, us: dict, wide: int, r1: str = "", rw: str = "") -> str:
    r1 = r1 or f"{lc[1] / us[1]:.2f}"
    rw = rw or f"{lc[wide] / us[wide]:.2f}"
    return (f"| {model} | {rnd} | {lc[1]:.1f} | {us[1]:.1f} | {r1} | {lc[wide]:.1f} | {us[wide]:.1f} | {rw} "
            f"| {lc[wide] / lc[1]:.2f} | {us[wide] / us[1]:.2f} |\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--rows", default="1,8", help="row counts; 1 is always included")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--min-time", type=float, default=3.0, help="decode_cost's seconds per row count")
    ap.add_argument("--llama-pages", choices=("huge", "4k"), default="huge",
                    help="llama-bench's weights in huge pages (glibc's malloc tunable) as ours are, or 4 KiB pages")
    ap.add_argument("--isa", choices=tuple(ISA_FLAGS), default="native",
                    help="both engines built for this CPU, or for AVX2 alone (as on a Zen 3)")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    rows = sorted({1, *(int(m) for m in a.rows.split(","))})
    bench = build_native(isa=a.isa) / "llama-bench"
    runs = []
    for rnd in range(a.rounds):
        for model in a.models.split(","):
            res = {}
            for side in (("llama", "ours") if rnd % 2 == 0 else ("ours", "llama")):
                res[side] = (llama_bench(bench, gguf_of(model), rows, a.context, a.llama_pages == "huge")
                             if side == "llama"
                             else ours(model, rows, a.context, a.min_time, a.isa))
            runs.append({"model": model, "round": rnd + 1, **res})
            print(f"round {rnd + 1} {model}: llama.cpp {res['llama']} ours {res['ours']}", file=sys.stderr, flush=True)
    md = markdown(runs, rows, a.context, a.llama_pages == "huge", a.isa)
    print(md)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "cpu": cpu_info(), "runs": runs}, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(md)


if __name__ == "__main__":
    main()
