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


class _Forwards:
    """Fake forwards for a HintTrial: each takes t0_ms or t1_ms by the hint set when it runs, times a
    drift factor that grows forward by forward (a machine slowing down)."""

    def __init__(self, t0_ms: float, t1_ms: float, drift: float = 0.0):
        self.t0, self.ms, self.drift = False, {True: t0_ms, False: t1_ms}, drift
        self.hints: list[bool] = []

    def set_t0(self, on: bool) -> None:
        self.t0 = on

    def run(self, trial: tune.HintTrial, rows: int = 1) -> dict | None:
        trial.before()
        self.hints.append(self.t0)
        return trial.after(rows, self.ms[self.t0] / 1e3 * (1.0 + self.drift * len(self.hints)))


def _until_chosen(f: _Forwards, trial: tune.HintTrial, rows=lambda i: 1) -> tuple[dict, int]:
    for i in range(2000):
        rec = f.run(trial, rows(i))
        if rec is not None:
            return rec, i + 1
    raise AssertionError("the trial never chose")


@pytest.mark.parametrize("t0_ms,want", [(17.0, "t0"), (18.6, "t0"), (18.9, "t1"), (26.0, "t1")])
def test_the_prefetch_trial_keeps_t0_only_when_faster_by_the_margin(t0_ms, want):
    """t0 where its forwards are faster by more than HINT_MARGIN (Zen 5: 17 vs 19 ms), else the default t1,
    even while the machine slows down by 1% a forward (pairs are neighbours); the choice is left set."""
    f = _Forwards(t0_ms, 19.0, drift=0.01)
    trial = tune.HintTrial(f.set_t0)
    rec, n = _until_chosen(f, trial)
    assert rec["prefetch"] == want and f.t0 == (want == "t0") and rec["pairs"] == tune.TRIAL_PAIRS
    assert n == tune.TRIAL_SKIP + 2 * tune.TRIAL_PAIRS
    assert not any(f.hints[:tune.TRIAL_SKIP])  # the first forwards run with the default
    trial_hints = f.hints[tune.TRIAL_SKIP:]
    assert trial_hints.count(True) == trial_hints.count(False) == tune.TRIAL_PAIRS
    firsts = trial_hints[::2]  # the hint each pair starts with: half t1, half t0
    assert firsts.count(True) == firsts.count(False)
    assert f.run(trial) is None and f.t0 == (want == "t0")  # chosen once, then left alone


def test_after_its_choice_a_trial_sets_its_hint_before_every_forward():
    """The hint is process-global: another engine (or anything else) may change it between two
    forwards of this one, which still run under this engine's choice (and before the trial's
    turns begin, under the default)."""
    f = _Forwards(17.0, 19.0)
    trial = tune.HintTrial(f.set_t0)
    f.set_t0(True)
    f.run(trial)
    assert f.hints == [False]  # a skipped forward: the default, whatever was set before
    rec, _ = _until_chosen(f, trial)
    assert rec["prefetch"] == "t0"
    for other in (False, True, False):
        f.set_t0(other)  # another engine's forward, say
        f.run(trial)
        assert f.hints[-1] is True


def test_the_prefetch_trial_pairs_only_narrow_forwards_of_one_width():
    """Forwards wider than TRIAL_ROWS (compute bound) and neighbours of different widths form no
    pair: a t0 that only looks faster because its forwards were narrower is not chosen."""
    f = _Forwards(19.0, 19.0)
    f.ms = None  # times by width below
    trial = tune.HintTrial(f.set_t0)

    def run(rows: int) -> dict | None:
        trial.before()
        f.hints.append(f.t0)
        return trial.after(rows, (10.0 if f.t0 else 19.0) * rows / 1e3 if rows > 1 else 0.019)

    widths = [1, 2] * 20 + [8] * 40
    recs = [run(w) for w in [1] * tune.TRIAL_SKIP + widths]
    assert not any(recs) and trial.ratios == []
    recs = [run(1) for _ in range(2 * tune.TRIAL_PAIRS)]
    assert recs[-1]["prefetch"] == "t1" and recs[-1]["t0_over_t1"] == 1.0


def test_a_trial_short_of_pairs_gives_up_on_the_default():
    f = _Forwards(10.0, 19.0)
    trial = tune.HintTrial(f.set_t0)
    rec, n = _until_chosen(f, trial, rows=lambda i: 16)  # prefill-sized forwards only
    assert rec == {"prefetch": "t1", "source": "measured", "pairs": 0, "t0_over_t1": None}
    assert n == tune.TRIAL_SKIP + tune.TRIAL_GIVE_UP and f.t0 is False


def test_env_forces_a_prefetch_hint_and_a_bad_value_is_refused(monkeypatch):
    f = _Forwards(10.0, 20.0)
    monkeypatch.setenv(tune.HINT_ENV, "t0")
    trial, rec = tune.HintTrial.begin(f.set_t0)
    assert trial is None and rec == {"prefetch": "t0", "source": tune.HINT_ENV} and f.t0 is True
    monkeypatch.setenv(tune.HINT_ENV, "t2")
    with pytest.raises(tune.BadVariant, match=tune.HINT_ENV):
        tune.HintTrial.begin(f.set_t0)
    monkeypatch.setenv(tune.HINT_ENV, "auto")
    trial, rec = tune.HintTrial.begin(f.set_t0)
    assert rec is None and trial is not None and f.t0 is False


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


def test_an_engine_on_the_cpu_chooses_its_prefetch_hint_over_its_first_forwards(tmp_path, caplog, monkeypatch):
    """A CPU engine's runner runs the hint trial over its real decode steps and logs the choice once
    (greedy output the same as under a forced hint: prefetch moves no bits); a forced hint is logged
    at start-up, and a bad SPECSERVE_PREFETCH_HINT fails the start naming the variable."""
    if not library.kernels_available():
        pytest.skip("no C compiler")
    import logging

    from tiny_models import make_tiny_target

    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.types import SamplingParams

    model = make_tiny_target(tmp_path)
    tokens = tune.TRIAL_SKIP + 2 * tune.TRIAL_PAIRS + 4
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def generate() -> list[int]:
        engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=128))
        return [t for out in engine.generate([1, 2, 3], params) for t in out.new_token_ids]

    try:
        monkeypatch.delenv(tune.HINT_ENV, raising=False)
        with caplog.at_level(logging.INFO, logger="specserve.engine"):
            measured = generate()
        assert caplog.text.count("weight prefetch: t") == 1
        assert f"(measured over {tune.TRIAL_PAIRS} pairs of forwards, median t0/t1 " in caplog.text
        caplog.clear()
        monkeypatch.setenv(tune.HINT_ENV, "t0")
        with caplog.at_level(logging.INFO, logger="specserve.engine"):
            assert generate() == measured and len(measured) == tokens
        assert "weight prefetch: t0 (SPECSERVE_PREFETCH_HINT)" in caplog.text
        monkeypatch.setenv(tune.HINT_ENV, "fast")
        with pytest.raises(tune.BadVariant, match=tune.HINT_ENV):
            LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64))
    finally:
        library.set_prefetch_t0(False)
