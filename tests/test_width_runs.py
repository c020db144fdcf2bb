"""benchmarks/width_runs.py: several decode_cost.py runs summarised per model (the README's
verification-width spread comes from it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _module():
    spec = importlib.util.spec_from_file_location("_bench_width_runs", BENCH / "width_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(path: Path, t1: float, t8: float) -> str:
    path.write_text(json.dumps({"results": [{"model": "m", "format": "auto", "median_ms": {"1": t1, "8": t8}}]}))
    return str(path)


def test_ratios_are_per_run_and_counted_against_the_goal(tmp_path):
    wr = _module()
    # ratios 1.4, 2.0, 1.5: the median of the per-run ratios, not a ratio of medians (10 / 14 ms -> 1.4)
    runs = [_run(tmp_path / "a.json", 10.0, 14.0), _run(tmp_path / "b.json", 8.0, 16.0),
            _run(tmp_path / "c.json", 12.0, 18.0)]
    md = wr.markdown(wr.collect(runs), goal=1.5)
    row = md.splitlines()[2].split(" | ")
    assert row[1] == "3" and row[2] == "10.0 (8.0-12.0)" and row[3] == "16.0 (14.0-18.0)"
    assert row[4] == "1.50 (1.40-2.00)" and row[5].rstrip(" |") == "2/3"
