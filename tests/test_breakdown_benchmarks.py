"""benchmarks/decode_cost.py's prefetch hint (--prefetch) and benchmarks/forward_breakdown.py's fused
path (--path fused), on a tiny model: what the README's decode_cost and breakdown tables rest on."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from specserve.kernels import library, tune

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # forward_breakdown imports decode_cost
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tiny_dir(tmp_path):
    if not library.kernels_available():
        pytest.skip("no C compiler")
    from tiny_models import make_tiny_target

    make_tiny_target(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def test_decode_cost_sets_the_hint_as_asked_and_names_it(tiny_dir, monkeypatch):
    """--prefetch t0 / t1 set that hint in every build compared; trial runs tune.HintTrial over one-row
    forwards (its record, with its pairs, lands in the results and under the table)."""
    dc = _load("decode_cost", monkeypatch)
    set_to: list[bool] = []
    monkeypatch.setattr(dc, "set_hint", lambda builds, t0: set_to.append(t0))
    a = argparse.Namespace(rows="1,2", context=16, layout="verify", min_time=0.0, min_rounds=2, max_rounds=2,
                           activations="int8", paths="fused", kv_dtypes="fp32", prefetch="t0")
    (r,) = dc.measure(tiny_dir, "none", a, {"": None})
    assert r["prefetch"] == {"prefetch": "t0", "source": "--prefetch"} and set_to == [True]
    a.prefetch = "trial"
    set_to.clear()
    (r,) = dc.measure(tiny_dir, "none", a, {"": None})
    assert r["prefetch"]["source"] == "measured" and r["prefetch"]["pairs"] == tune.TRIAL_PAIRS
    assert len(set_to) >= tune.TRIAL_SKIP + 2 * tune.TRIAL_PAIRS and True in set_to and False in set_to
    assert f"t0/t1 {r['prefetch']['t0_over_t1']}" in dc.markdown([r], a, 1)


def test_forward_breakdown_fused_reads_the_c_stage_timers(tiny_dir, monkeypatch):
    """--path fused: a time for every stage of the layers and for the rest of the forward; the timers
    are left off afterwards."""
    fb = _load("forward_breakdown", monkeypatch)
    a = argparse.Namespace(rows="1,2", context=16, rounds=2, path="fused")
    r = fb.measure(tiny_dir, a)
    assert set(r["labels"]) == set(library.DECODER_STAGES) | {"outside the layers", "total"}
    for m in (1, 2):
        cell = r["median_ms"][m]
        assert all(cell[s] > 0 for s in library.DECODER_STAGES) and cell["total"] > 0
    assert "fused path, C stage timers" in fb.markdown([r])
    assert not any(library.decoder_profile().values())  # switched off (and zeroed) by restore
