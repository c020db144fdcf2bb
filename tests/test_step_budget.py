"""The per-step time budget (--max-step-ms): the pass-cost fit on synthetic costs, the chunk sizes
it gives, and, on the real engine, that outputs do not change with it."""

from __future__ import annotations

import random

import pytest

from engine_utils import bench_prompts, chat_ids, make_engine, run_one
from specserve.engine.step_budget import MIN_CHUNK, STALL_FACTOR, batch_keys, prefill_budget, row_keys
from specserve.engine.types import SamplingParams
from specserve.speculative.adaptive import CostModel, PassFit

A, B, C = 0.004, 0.0015, 2e-7  # synthetic: 4 ms a pass, 1.5 ms a row, 0.2 us a key


def synthetic(rows: int, keys: int) -> float:
    return A + B * rows + C * keys


def trained(passes: list[tuple[int, int]] | None = None, noise: float = 0.0, seed: int = 0) -> PassFit:
    """A PassFit fed with synthetic passes: decode steps (1-8 rows, any context) and prefill chunks."""
    rnd, fit = random.Random(seed), PassFit()
    if passes is None:
        passes = [(n, row_keys(n, rnd.randrange(8000))) for n in (1, 2, 4, 8) for _ in range(20)]
        passes += [(c, row_keys(c, p)) for c in (64, 128, 256, 512, 1024) for p in (0, 1000, 4000, 7000)]
    for rows, keys in passes:
        fit.add(rows, keys, synthetic(rows, keys) * (1 + noise * rnd.uniform(-1, 1)))
    return fit


def test_row_keys_and_batch_keys_count_the_attention_work():
    import torch

    assert row_keys(1, 0) == 1 and row_keys(3, 10) == 11 + 12 + 13
    assert batch_keys(torch.tensor([10, 11, 12, 0, 1], dtype=torch.int32)) == 36 + 3


def test_the_fit_recovers_the_costs_of_passes_it_saw_and_extrapolates_in_context():
    fit = trained(noise=0.05)
    for rows, keys in ((1, 500), (4, 30000), (256, row_keys(256, 4000)), (128, row_keys(128, 8000))):
        assert fit.time(rows, keys) == pytest.approx(synthetic(rows, keys), rel=0.1)
    a, b, c = fit.coef()
    assert min(a, b, c) >= 0


def test_the_fit_ignores_spikes_of_a_shared_machine():
    fit = trained()
    for _ in range(3):  # a few steps ten times slower, in every group
        for rows, keys in [(n, row_keys(n, 100)) for n in (1, 2, 4, 8)] + [(256, row_keys(256, 4000))]:
            fit.add(rows, keys, 10 * synthetic(rows, keys))
    assert fit.time(256, row_keys(256, 4000)) == pytest.approx(synthetic(256, row_keys(256, 4000)), rel=0.1)


def test_the_fit_follows_a_machine_that_got_slower():
    fit = trained()
    before = fit.time(512, row_keys(512, 4000))
    for group in list(fit.groups.values()):  # every kind of pass run again a few times, twice as slow
        rows, keys, _ = group[-1]
        for _ in range(PassFit.PER_GROUP // 2 + 1):
            fit.add(rows, keys, 2 * synthetic(rows, keys))
    assert fit.time(512, row_keys(512, 4000)) == pytest.approx(2 * before, rel=0.05)


def test_the_fit_never_falls_with_more_work():
    fit = PassFit()
    fit.add(1, 10, 0.010)
    fit.add(8, 80, 0.009)  # noise: more rows measured faster
    fit.add(64, 3000, 0.050)
    a, b, c = fit.coef()
    assert min(a, b, c) >= 0
    assert fit.time(2, 20) <= fit.time(4, 40) <= fit.time(400, 100000)


def test_cost_model_feeds_the_fit_only_with_the_attention_work():
    cost = CostModel()
    cost.add(4, 0.01)  # a verification width from calibration: the table only
    assert 4 in cost.table and not cost.passes.groups
    cost.add(512, 0.5, keys=row_keys(512, 0))  # a prefill chunk: the fit only
    assert 512 not in cost.table and cost.passes.widest == 512


def test_budget_fills_the_step_and_shrinks_chunks_late_in_a_prompt():
    fit = trained()
    decode = [(1, 300)] * 4  # 4 streams, one row each
    early = prefill_budget(fit, 200, decode, [0], 2048)
    late = prefill_budget(fit, 200, decode, [7000], 2048)
    assert MIN_CHUNK < late < early < 2048
    for start, chunk in ((0, early), (7000, late)):  # the largest chunk within the budget
        rows, keys = 4 + chunk, 4 * row_keys(1, 300) + row_keys(chunk, start)
        assert synthetic(rows, keys) <= 0.2 * 1.1
        assert synthetic(rows + 1 + chunk // 10, keys + row_keys(chunk // 10 + 1, start + chunk)) > 0.2 * 0.9
    assert prefill_budget(fit, 400, decode, [7000], 2048) > late  # a larger budget, larger chunks


def test_budget_is_off_without_decode_rows_or_with_0_and_never_exceeds_the_tokens_left():
    fit = trained()
    assert prefill_budget(fit, 0, [(1, 10)], [0], 2048) == 2048  # --max-step-ms 0: fixed chunks
    assert prefill_budget(fit, 200, [], [0], 2048) == 2048  # nobody waits: full width
    assert prefill_budget(fit, 200, [(1, 10)], [], 2048) == 2048  # nothing to prefill
    assert prefill_budget(fit, 10_000, [(1, 10)], [0], 100) == 100  # --max-num-batched-tokens still caps


def test_when_decode_alone_fills_the_budget_a_step_may_take_twice_its_time():
    fit = trained()
    heavy = [(8, 7900)] * 8  # 64 verification rows at 8K context
    decode_s = synthetic(64, sum(row_keys(n, p) for n, p in heavy))
    assert decode_s > 0.050
    chunk = prefill_budget(fit, 50, heavy, [0], 2048)
    step_s = synthetic(64 + chunk, sum(row_keys(n, p) for n, p in heavy) + row_keys(chunk, 0))
    assert MIN_CHUNK < chunk and step_s == pytest.approx(STALL_FACTOR * decode_s, rel=0.1)


def test_a_prompt_advances_by_min_chunk_whatever_the_costs():
    fit = PassFit()
    for rows, keys in ((1, 10), (64, 2000), (300, 90000)):
        fit.add(rows, keys, 10.0 * rows)  # 10 s a row
    assert prefill_budget(fit, 50, [(1, 10)], [0], 2048) == MIN_CHUNK


def test_budget_grows_chunks_step_by_step_from_a_cold_model():
    fit = PassFit()
    sizes, start = [], 0
    while start < 8000:  # a first 8K prompt: each step's pass is measured, then the next one sized
        chunk = min(prefill_budget(fit, 10_000, [(1, 5)], [start], 2048), 8000 - start)
        rows, keys = 1 + chunk, row_keys(1, 5) + row_keys(chunk, start)
        fit.add(rows, keys, synthetic(rows, keys))
        sizes.append(chunk)
        start += chunk
    assert sizes[0] <= 64 and all(b <= 2 * (a + 1) for a, b in zip(sizes, sizes[1:]))  # never a leap
    assert 2048 in sizes and len(sizes) <= 16  # but the budget (generous here) is reached soon


# ---------------------------------------------------------------- the real engine: lossless

class FixedCosts:
    """A pass-cost model frozen at synthetic costs (the real engine's own measurements are not
    kept), so that the chunks it gives do not depend on the machine."""

    widest, most_keys = 10**9, 10**18

    def add(self, *args) -> None:
        pass

    def time(self, rows: int, keys: int) -> float:
        return 0.002 + 0.001 * rows + 2e-6 * keys


@pytest.fixture(scope="module")
def long_and_short():
    one_shot = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--max-model-len", "2048",
                           "--no-enable-prefix-caching", "--max-step-ms", "0")
    prompts = [chat_ids(one_shot, t) for t in bench_prompts(3)[:9]]
    long_prompt = sum(prompts[3:], [])[:600]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = [run_one(one_shot, p, params)[0] for p in prompts[:3] + [long_prompt]]
    return prompts[:3], long_prompt, params, want


def _streams_then_long_prompt(engine, shorts, long_prompt, params):
    """Streams decode; once each has tokens the long prompt arrives. Returns tokens and prefill chunks."""
    chunks, schedule = [], engine.scheduler.schedule

    def recording(drafting, **kw):
        rows = schedule(drafting, **kw)
        chunks.extend(r.count for r in rows if r.seq.request_id == "long" and not r.decode and r.count > 1)
        return rows

    engine.scheduler.schedule = recording
    got = {f"s{i}": [] for i in range(len(shorts))} | {"long": []}
    for i, ids in enumerate(shorts):
        engine.add_request(f"s{i}", ids, params)
    added = False
    while engine.has_work() or not added:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        if not added and all(len(got[f"s{i}"]) >= 2 for i in range(len(shorts))):
            engine.add_request("long", long_prompt, params)
            added = True
    engine.scheduler.schedule = schedule
    return [got[f"s{i}"] for i in range(len(shorts))] + [got["long"]], chunks


def test_outputs_are_identical_with_the_budget_on(long_and_short):
    shorts, long_prompt, params, want = long_and_short
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--max-model-len", "2048",
                         "--no-enable-prefix-caching", "--max-step-ms", "150")
    engine.cost.passes = FixedCosts()  # chunks from the budget, not from this machine's speed
    tokens, chunks = _streams_then_long_prompt(engine, shorts, long_prompt, params)
    assert tokens == want
    assert len(chunks) > 3 and len(set(chunks)) > 1 and sum(chunks) >= len(long_prompt) - 1  # chunks of many sizes
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.cost.passes = PassFit()  # and with the costs this machine measures, whatever they are
    tokens, _ = _streams_then_long_prompt(engine, shorts, long_prompt, params)
    assert tokens == want
