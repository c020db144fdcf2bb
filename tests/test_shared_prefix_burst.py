"""benchmarks/shared_prefix_burst.py: requests sharing a prefix, computed once or each its own (the
README's table comes from it), run end to end on the default model at a small size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "shared_prefix_burst.py"


def test_shared_prefix_is_computed_once_with_the_same_outputs(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(BENCH), "--requests", "3", "--prefix-tokens", "64", "--tokens", "2",
                    "--rounds", "1", "--out", str(out)], check=True, capture_output=True, timeout=600)
    rows = {(r["case"], r["mode"]): r for r in json.loads(out.read_text())}
    assert set(rows) == {(c, m) for c in ("n choices", "burst") for m in ("shared", "each its own")}
    for case in ("n choices", "burst"):
        shared, own = rows[(case, "shared")], rows[(case, "each its own")]
        assert shared["identical"] and own["identical"]
        # each its own: three whole prompts; shared: one, plus each other request's tokens past the prefix
        assert own["computed"] >= 3 * 64 and shared["computed"] < own["computed"] - 2 * 48
