"""The C kernel build chosen per CPU by measurement (specserve/kernels/tune.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.kernels import build, library, ops, tune


def test_pick_prefers_native_within_the_margin():
    assert tune.pick({"native": 1.0, "native256": 0.99}) == "native"
    assert tune.pick({"native": 1.0, "native256": 0.90}) == "native256"
    assert tune.pick({"native": 0.80, "native256": 1.0}) == "native"
    assert tune.pick({"native": 1.0}) == "native"


def test_contenders_follow_the_cpu_flags():
    assert tune.contenders({"avx2", "fma"}) == ["native"]
    assert tune.contenders({"avx2", "avx512f", "avx512bw"}) == ["native", "native256"]


def test_env_forces_a_build_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(tune.ENV, "avx2")
    assert tune.choose() == {"variant": "avx2", "times": {}, "source": tune.ENV}
    monkeypatch.setenv(tune.ENV, "avx9000")
    with pytest.raises(tune.BadVariant, match="avx9000"):
        tune.choose()


def test_the_choice_is_measured_once_and_then_read(monkeypatch, tmp_path):
    if build.get_build("native").lib is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv(tune.ENV, raising=False)
    record = tmp_path / "tune-x.json"
    monkeypatch.setattr(tune, "_record_path", lambda: record)
    monkeypatch.setattr(tune, "contenders", lambda flags: ["native", "avx2"])
    calls = []

    def fake_measure(variants, rounds=tune.ROUNDS):
        calls.append(list(variants))
        return {"native": 0.010, "avx2": 0.005}

    monkeypatch.setattr(tune, "measure", fake_measure)
    first = tune.choose()
    assert first["variant"] == "avx2" and first["source"] == "measured" and calls == [["native", "avx2"]]
    assert json.loads(record.read_text()) == {"variant": "avx2", "times": {"native": 10.0, "avx2": 5.0}}
    again = tune.choose()
    assert again["variant"] == "avx2" and again["source"] == str(record) and len(calls) == 1
    record.write_text("{not json")  # a corrupt record is measured again
    assert tune.choose()["source"] == "measured" and len(calls) == 2


def test_measure_times_every_build_with_the_same_work():
    if build.get_build("native").lib is None or build.get_build("avx2").lib is None:
        pytest.skip("no C compiler / not x86")
    times = tune.measure(["native", "avx2"], rounds=1)
    assert set(times) == {"native", "avx2"} and all(0 < t < 60 for t in times.values())


def test_kernels_info_names_the_chosen_build():
    info = ops.kernels_info()
    if not info["available"]:
        pytest.skip("no C compiler")
    assert info["variant"] in tune.CHOOSABLE and info["variant"] == library.chosen_build()["variant"]
    assert info["variant_source"]


@pytest.mark.parametrize("impl", ["c-native", "c-native256"])
def test_every_choosable_build_gives_the_same_bits(impl):
    if "avx512f" not in tune.cpu_flags() and impl == "c-native256":
        pytest.skip("native256 is only built on AVX-512 CPUs")
    try:
        ops.linear(torch.zeros(1, 32), torch.zeros(4, 32), impl=impl)
    except ops.KernelError as e:
        pytest.skip(str(e))
    g = torch.Generator().manual_seed(3)
    w = ops.Int8Weight.from_float(torch.randn(48, 512, generator=g))
    x = torch.randn(5, 512, generator=g)
    assert torch.equal(ops.linear(x, w, impl=impl), ops.linear(x, w, impl="c-scalar"))


def test_serve_logs_the_chosen_build(caplog):
    if not ops.kernels_info()["available"]:
        pytest.skip("no C compiler")
    from specserve.commands.serve import _log_kernels

    with caplog.at_level("INFO", logger="specserve.server"):
        _log_kernels()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("C kernels:"))
    assert f"{library.chosen_build()['variant']} build" in line and "integer dot:" in line


def test_using_routes_the_chosen_build_and_restores_it():
    """benchmarks compare kernel builds in one process: calls go to the given library inside the
    block, to the chosen build again after it, even when the block raises."""
    variant = library.chosen_build()["variant"]
    own = library._get_lib(variant)
    other = object()
    with library.using(other):
        assert library._get_lib(variant) is other
    assert library._get_lib(variant) is own
    with pytest.raises(RuntimeError):
        with library.using(other):
            raise RuntimeError("benchmark failed")
    assert library._get_lib(variant) is own


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1"])
def test_random_block_weights_are_finite_and_read_as_gguf_reads_them(qtype):
    import gguf
    import numpy as np

    from specserve.kernels.linear import linear

    w = tune.random_block_weight(qtype, 32, 512, torch.Generator().manual_seed(0))
    ref = gguf.quants.dequantize(w.raw.numpy(), gguf.GGMLQuantizationType[qtype])  # [32, 512]
    deq = w.dequantize()
    assert deq.shape == (32, 512) and torch.isfinite(deq).all()
    np.testing.assert_array_equal(deq.numpy(), ref)
    assert torch.isfinite(linear(torch.randn(2, 512), w)).all()


class _Clock:
    """A fake clock that a run advances by the time of the hint set when it runs."""

    def __init__(self, t0_ms: float, t1_ms: float):
        self.now, self.t0 = 0.0, False
        self.cost = {True: t0_ms / 1e3, False: t1_ms / 1e3}
        self.runs: list[bool] = []

    def run(self) -> None:
        self.runs.append(self.t0)
        self.now += self.cost[self.t0]

    def set_t0(self, on: bool) -> None:
        self.t0 = on


@pytest.mark.parametrize("t0_ms,want", [(17.0, "t0"), (18.9, "t1"), (26.0, "t1")])
def test_the_prefetch_hint_is_the_faster_by_more_than_the_margin(monkeypatch, t0_ms, want):
    """t0 where it is faster by more than MARGIN (Zen 5: 17 vs 19 ms), else the default t1; the
    chosen hint is left set, and both hints were timed the same number of times."""
    monkeypatch.delenv(tune.HINT_ENV, raising=False)
    c = _Clock(t0_ms, 19.0)
    rec = tune.choose_prefetch(c.run, c.set_t0, rounds=4, clock=lambda: c.now)
    assert rec["prefetch"] == want and c.t0 == (want == "t0") and rec["source"] == "measured"
    assert rec["times"] == {"t1": 19.0, "t0": t0_ms}
    timed = c.runs[tune.HINT_WARM_UP:]
    assert timed.count(True) == timed.count(False) == 4


def test_env_forces_a_prefetch_hint_and_a_bad_value_is_refused(monkeypatch):
    c = _Clock(10.0, 20.0)
    monkeypatch.setenv(tune.HINT_ENV, "t1")
    assert tune.choose_prefetch(c.run, c.set_t0, clock=lambda: c.now)["prefetch"] == "t1"
    assert not c.runs and c.t0 is False
    monkeypatch.setenv(tune.HINT_ENV, "t2")
    with pytest.raises(tune.BadVariant, match=tune.HINT_ENV):
        tune.choose_prefetch(c.run, c.set_t0)


def test_the_prefetch_hint_moves_no_bits():
    """A panel linear over Q4_K and Q6_K weights at 1 and 8 rows gives the same bits under either
    prefetch hint (a stream longer than the prefetch distance)."""
    if not library.kernels_available():
        pytest.skip("no C compiler")
    from specserve.kernels.linear import linear

    g = torch.Generator().manual_seed(1)
    try:
        for qtype in ("Q4_K", "Q6_K"):
            w = tune.random_block_weight(qtype, 512, 2048, g)
            for m in (1, 8):
                x = torch.randn(m, 2048, generator=g)
                assert library.set_prefetch_t0(False)
                a = linear(x, w)
                library.set_prefetch_t0(True)
                assert torch.equal(a, linear(x, w)) and torch.isfinite(a).all()
    finally:
        library.set_prefetch_t0(False)


def test_an_engine_on_the_cpu_times_its_prefetch_hint(tmp_path, caplog, monkeypatch):
    """A CPU engine chooses the hint on its own model's one-row forward at start-up (logged); a bad
    SPECSERVE_PREFETCH_HINT fails the start naming the variable."""
    if not library.kernels_available():
        pytest.skip("no C compiler")
    import logging

    from tiny_models import make_tiny_target

    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine

    model = make_tiny_target(tmp_path)
    monkeypatch.delenv(tune.HINT_ENV, raising=False)
    try:
        with caplog.at_level(logging.INFO, logger="specserve.engine"):
            LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64))
        assert "weight prefetch: t" in caplog.text and "(measured;" in caplog.text
        monkeypatch.setenv(tune.HINT_ENV, "fast")
        with pytest.raises(tune.BadVariant, match=tune.HINT_ENV):
            LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64))
    finally:
        library.set_prefetch_t0(False)
