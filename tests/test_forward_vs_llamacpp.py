"""benchmarks/forward_vs_llamacpp.py: llama-bench's rows read as ms per forward, and the table's
ratios and medians (the README's one-forward table comes from them)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def fvl(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # for its native_llamacpp import; undone after the test
    spec = importlib.util.spec_from_file_location("_bench_forward_vs_llamacpp", BENCH / "forward_vs_llamacpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_llama_bench_rows_become_ms_per_forward(fvl, monkeypatch):
    seen = []

    def fake_rows(bench, gguf, *args, env=None):
        seen.append((args, env))
        return [{"n_prompt": 8, "n_gen": 0, "avg_ts": 200.0},  # 8 tokens at 200 tok/s: 40 ms a forward
                {"n_prompt": 0, "n_gen": 32, "avg_ts": 25.0}]  # generation: 40 ms a token

    monkeypatch.setattr(fvl, "llama_bench_rows", fake_rows)
    assert fvl.llama_bench(Path("llama-bench"), Path("m.gguf"), [1, 8], 512) == {8: 40.0, 1: 40.0}
    fvl.llama_bench(Path("llama-bench"), Path("m.gguf"), [1, 8], 512, huge=False)
    (args, env), (_, env_4k) = seen
    assert args[args.index("-d") + 1] == "512" and args[args.index("-p") + 1] == "8"
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"} and env_4k is None  # huge pages by default


def test_table_gives_each_rounds_ratio_and_the_medians(fvl):
    runs = [{"model": "m", "round": 1, "llama": {1: 40.0, 8: 200.0}, "ours": {1: 20.0, 8: 40.0}},
            {"model": "m", "round": 2, "llama": {1: 30.0, 8: 100.0}, "ours": {1: 30.0, 8: 50.0}}]
    md = fvl.markdown(runs, [1, 8], 512)
    lines = [ln for ln in md.splitlines() if ln.startswith(("| m |", "| **m** |"))]
    assert lines[0].split(" | ")[4] == "2.00" and lines[1].split(" | ")[4] == "1.00"  # llama.cpp / ours, 1 row
    median = lines[2].split(" | ")
    assert median[4] == "1.50 (1.00-2.00)" and median[7] == "3.50 (2.00-5.00)"
    assert median[2:4] == ["35.0", "25.0"]  # median ms per engine


def test_ours_runs_decode_cost_with_the_kernel_build_asked_for(fvl, monkeypatch):
    """--isa avx2: decode_cost runs in its own process with the AVX2 kernel build (as on a Zen 3);
    the default leaves the build to the start-up contest."""
    envs = []

    def fake_run(cmd, env=None, **kw):
        envs.append(env)
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text('{"results": [{"median_ms": {"1": 5.0, "8": 9.0}}]}')

    monkeypatch.setattr(fvl.subprocess, "run", fake_run)
    assert fvl.ours("m", [1, 8], 512, 1.0, "avx2") == {1: 5.0, 8: 9.0}
    fvl.ours("m", [1, 8], 512, 1.0)
    assert envs[0]["SPECSERVE_KERNEL_VARIANT"] == "avx2"
    assert envs[1].get("SPECSERVE_KERNEL_VARIANT") == os.environ.get("SPECSERVE_KERNEL_VARIANT")
    assert "both engines built for avx2" in fvl.markdown(
        [{"model": "m", "round": 1, "llama": {1: 4.0, 8: 9.0}, "ours": {1: 5.0, 8: 9.0}}], [1, 8], 512, isa="avx2")
