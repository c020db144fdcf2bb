"""The scheduler and the step's order (schedule -> propose -> forward -> verify -> commit), on a
tiny in-process model."""

from __future__ import annotations

import pytest

from engine_utils import run_all
from specserve.errors import RequestError
from specserve.engine.model_runner import logit_rows
from specserve.engine.scheduler import ScheduledRow, Scheduler
from specserve.engine.sequence import Sequence
from specserve.engine.types import SamplingParams
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.ngram import NgramDrafter

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8] * 6, list(range(40, 90)), [9] * 7]


def test_a_step_mixes_decode_rows_and_prefill_chunks_within_the_token_budget(tiny_engine):
    eng = tiny_engine(max_num_batched_tokens=16)
    eng.add_request("a", PROMPTS[0], GREEDY)
    eng.step()  # a: prompt done (24 tokens > 16: two chunks)
    eng.step()
    eng.add_request("b", PROMPTS[1], GREEDY)
    eng.scheduler.admit()
    rows = eng.scheduler.schedule(drafting=False)
    assert [(r.seq.request_id, r.decode, r.count) for r in rows] == [("a", True, 1), ("b", False, 15)]
    Scheduler.place(rows)
    assert [r.start for r in rows] == [0, 1]
    assert logit_rows(rows) == [0]  # b's chunk does not end its prompt: no logits


def test_draft_lengths_are_chosen_with_the_steps_width_known(tiny_engine):
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, adaptive=True)
    eng = tiny_engine(spec, NgramDrafter(1, 3), max_num_batched_tokens=64)
    seen = []
    real = eng.policy.lengths

    def lengths(seqs, limits, extra_width=0):
        seen.append((len(seqs), extra_width))
        return real(seqs, limits, extra_width)

    eng.policy.lengths = lengths
    eng.add_request("a", PROMPTS[0], GREEDY)
    while not eng.running or eng.running[0].num_computed < len(PROMPTS[0]):
        eng.step()
    eng.add_request("b", PROMPTS[1], GREEDY)
    eng.step()  # a decodes while b's 50-token prompt prefills in the same pass
    assert seen[-1] == (1, 50)


def test_rows_reserve_room_for_their_drafts_before_the_drafter_runs(tiny_engine):
    spec = SpeculativeConfig("ngram", num_speculative_tokens=5, prompt_lookup_min=1, adaptive=False)
    eng = tiny_engine(spec, NgramDrafter(1, 3), block_size=4)
    eng.add_request("a", PROMPTS[0], GREEDY)
    eng.step()
    eng.scheduler.admit()
    (row,) = eng.scheduler.schedule(drafting=True)
    assert isinstance(row, ScheduledRow) and row.num_drafts == 5 and row.drafts == []
    seq = row.seq
    assert len(seq.cache.tables[0].blocks) * 4 >= seq.num_computed + 1 + 5


def test_speculative_steps_equal_plain_and_leave_the_cache_idle(tiny_engine):
    plain = run_all(tiny_engine(), PROMPTS, GREEDY)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False)
    eng = tiny_engine(spec, NgramDrafter(1, 3), max_num_batched_tokens=8, block_size=4)
    assert run_all(eng, PROMPTS, GREEDY) == plain
    assert eng.totals.draft_tokens > 0 and eng.cache.idle()


def prefill_tokens(eng) -> list[tuple[str, int]]:
    """Run eng to the end; (request, rows) of every prefill chunk it computed."""
    seen, real = [], eng.scheduler.schedule

    def schedule(*a, **kw):
        rows = real(*a, **kw)
        seen.extend((r.seq.request_id, r.count) for r in rows if not r.decode)
        return rows

    eng.scheduler.schedule = schedule
    run_to_end(eng)
    return seen


def run_to_end(eng, max_steps: int = 200) -> list:
    """Step eng until nothing waits or runs (a request stuck waiting fails, not hangs); its outputs."""
    outs = []
    for _ in range(max_steps):
        if not (eng.scheduler.waiting or eng.running):
            return outs
        outs += eng.step()
    raise AssertionError(f"still running after {max_steps} steps")


def test_requests_sharing_a_prompt_compute_it_once(tiny_engine):
    shared = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    prompts = {"a": shared, "b": shared, "c": [7] * 20, "d": shared[:40] + [1, 2, 3]}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = {k: run_all(tiny_engine(), [p], params)[0] for k, p in prompts.items()}
    eng = tiny_engine()
    got = {k: [] for k in prompts}
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    eng.scheduler.admit()  # c does not share a's prompt: it does not wait behind b and d
    assert [s.request_id for s in eng.running] == ["a", "c"]
    assert [s.request_id for s in eng.scheduler.waiting] == ["b", "d"]
    real_step = eng.step

    last = {}

    def step():
        outs = real_step()
        for o in outs:
            got[o.request_id] += o.new_token_ids
            last[o.request_id] = o
        return outs

    eng.step = step
    computed = prefill_tokens(eng)
    # b and d attach a's three (d: two) blocks once a's prefill commits them, and compute the rest
    assert sorted(computed) == [("a", 50), ("b", 2), ("c", 20), ("d", 11)]
    assert got == alone  # the same tokens as each request alone
    # what each reports as cached (the server's usage and timings.cache_n)
    assert {rid: o.cached_tokens for rid, o in last.items()} == {"a": 0, "b": 48, "c": 0, "d": 32}
    assert eng.cache.idle()


def test_without_prefix_caching_requests_sharing_a_prompt_do_not_wait(tiny_engine):
    eng = tiny_engine(enable_prefix_caching=False)
    for rid in ("a", "b"):
        eng.add_request(rid, list(range(100, 150)), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.scheduler.admit()
    assert [s.request_id for s in eng.running] == ["a", "b"]


def test_a_request_waiting_for_a_prefill_runs_when_that_request_is_aborted(tiny_engine):
    shared, params = list(range(100, 150)), SamplingParams(max_tokens=5, ignore_eos=True)
    alone = run_all(tiny_engine(), [shared], params)[0]
    eng = tiny_engine(max_num_batched_tokens=16)  # a's prompt takes several steps
    eng.add_request("a", shared, params)
    eng.add_request("b", shared, params)
    eng.step()
    assert [s.request_id for s in eng.scheduler.waiting] == ["b"]
    eng.abort("a")
    got = [t for o in run_to_end(eng) if o.request_id == "b" for t in o.new_token_ids]
    assert got == alone and eng.cache.idle()


def test_requests_sharing_a_prompt_compute_it_once_in_a_draft_models_cache_too(tiny_target, tiny_engine):
    """Four requests with one 50-token prompt (a request with n = 4): the draft model (the tiny target
    drafting for itself) computes the prompt for the first; the others find its three full blocks in
    the draft's prefix cache and compute only the rest, with the same tokens as plain greedy."""
    from specserve.speculative.draft_model import DraftModelDrafter

    shared = list(range(100, 150))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = run_all(tiny_engine(), [shared], params)[0]
    drafter = DraftModelDrafter(tiny_target, num_blocks=64, block_size=16, max_model_len=256)
    spec = SpeculativeConfig("draft_model", model="tiny", num_speculative_tokens=3, adaptive=False)
    eng = tiny_engine(spec, drafter)
    rows, real = [], drafter._forward

    def forward(batch_rows):
        rows.extend((s.request_id, len(toks)) for s, toks, _ in batch_rows)  # (guesses besides)
        return real(batch_rows)

    drafter._forward = forward
    assert run_all(eng, [shared] * 4, params) == [plain] * 4
    first = {}
    for rid, n in rows:
        first.setdefault(rid, n)  # each request's first draft forward: its prompt and first token, less cached
    assert sorted(first.values()) == [3, 3, 3, 51]  # 48 of 50 from the first request's committed blocks
    assert sum(n for _, n in rows) < 51 + 3 * 3 + 4 * 8 * 2  # prompt once, then a token or two a step each
    assert eng.totals.draft_tokens > 0 and eng.cache.idle()


def test_a_draft_model_reads_a_long_prompt_only_where_the_answer_can_repay_it(tiny_target, tiny_engine):
    """The engine's policy asks the draft model what it has not read (the whole 300-token prompt before
    its first proposal, DraftModelDrafter.unread): with an 8-token answer a catch-up dearer than the
    drafts could save keeps the sequence plain, a free one lets it draft; the same tokens either way.
    Costs are set, so the machine's speed decides nothing."""
    from specserve.speculative.draft_model import DraftModelDrafter

    prompt = [100 + i % 150 for i in range(300)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = run_all(tiny_engine(max_model_len=512), [prompt], params)[0]
    for catch_up, drafts in ((1e3, False), (0.0, True)):
        drafter = DraftModelDrafter(tiny_target, num_blocks=64, block_size=16, max_model_len=512)
        seq = Sequence("probe", prompt, params, None)
        assert drafter.unread(seq) == 300
        drafter.on_finished(seq)
        drafter.draft_cost = lambda k: 0.0
        drafter.catch_up_cost = lambda n, c=catch_up: c if n > 1 else 0.0
        eng = tiny_engine(SpeculativeConfig("draft_model", model="tiny", num_speculative_tokens=3), drafter,
                          max_model_len=512)
        eng.cost.time = lambda width: 0.010 + 0.001 * width  # verification widths nearly free
        assert run_all(eng, [prompt], params) == [plain]
        assert (eng.totals.draft_tokens > 0) is drafts, catch_up


def test_after_short_answers_a_long_prompt_without_max_tokens_decodes_plain(tiny_target, tiny_engine):
    """The engine tells its policy each finished answer's length: after short answers, a long prompt
    whose budget runs far past them (a chat request without max_tokens) decodes plain where the draft's
    catch-up costs more than those lengths repay, and drafts once its answer has run as long again as
    the catch-up needs; a fresh engine, knowing no answers, drafts from its first step. The same tokens
    either way; costs are set."""
    from specserve.speculative.draft_model import DraftModelDrafter

    long_prompt = [100 + i % 150 for i in range(300)]
    long_params = SamplingParams(max_tokens=200, ignore_eos=True)
    plain = run_all(tiny_engine(max_model_len=512), [long_prompt], long_params)[0]
    first_draft = {}
    for warm in (False, True):
        drafter = DraftModelDrafter(tiny_target, num_blocks=64, block_size=16, max_model_len=512)
        drafter.draft_cost = lambda k: 0.0
        drafter.catch_up_cost = lambda n: 0.3 if n > 1 else 0.0  # 40-80 tokens' saving at the costs below
        eng = tiny_engine(SpeculativeConfig("draft_model", model="tiny", num_speculative_tokens=3), drafter,
                          max_model_len=512)
        eng.cost.time = lambda width: 0.010 + 0.001 * width
        if warm:
            run_all(eng, [[5, 6, 7, 8] * 4] * 3, SamplingParams(max_tokens=6, ignore_eos=True))
            assert list(eng.policy.answers.seen) == [6, 6, 6]
        real = eng.policy.lengths

        def lengths(seqs, limits, extra_width=0, real=real, warm=warm):
            ks = real(seqs, limits, extra_width)
            if seqs[0].prompt_ids == long_prompt and ks[0]:
                first_draft.setdefault(warm, len(seqs[0].output_ids))
            return ks

        eng.policy.lengths = lengths
        assert run_all(eng, [long_prompt], long_params) == [plain]
    assert first_draft[False] <= 1  # the 200-token budget repays the catch-up
    assert 20 <= first_draft[True] < 150  # 6 tokens expected at first; later as many again as made


def test_a_request_may_use_all_of_a_pool_that_holds_one_sequence(tiny_engine):
    """A pool of one max-length sequence (--max-num-seqs 1) serves a request that fills the context (a
    chat request without max_tokens is given the rest of it), drafting included: drafts are capped by the
    tokens left, so nothing is written past prompt + max_tokens. One token more is refused up front."""
    prompt = [5, 6, 7, 8] * 4
    room = SamplingParams(max_tokens=256 - len(prompt), ignore_eos=True)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    outs = []
    for s, d in ((None, None), (spec, NgramDrafter(1, 3))):
        eng = tiny_engine(s, d, max_model_len=256, max_num_seqs=1)
        assert eng.blocks.num_blocks * 16 == 256
        outs.append(run_all(eng, [prompt], room)[0])
        assert len(outs[-1]) == room.max_tokens and eng.cache.idle()
        assert (eng.totals.draft_tokens > 0) is (s is not None)
        with pytest.raises(RequestError, match="context length"):
            eng.add_request("over", prompt, SamplingParams(max_tokens=room.max_tokens + 1))
    assert outs[0] == outs[1]


def test_a_drafting_engine_decodes_plain_now_and_then_to_re_time_one_row(tiny_target, tiny_engine):
    """Cost probes through the engine: a drafting sequence (the draft is the target, so every draft is
    kept) decodes plain once the one-row width was last timed more than ``every`` passes ago, and the
    runner's timing of that step re-stamps it. Costs are set (54 passes between probes at these); the
    tokens equal plain's."""
    from specserve.speculative.draft_model import DraftModelDrafter

    prompt = [5, 6, 7, 8] * 4
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    plain = run_all(tiny_engine(max_model_len=512), [prompt], params)[0]
    drafter = DraftModelDrafter(tiny_target, num_blocks=64, block_size=16, max_model_len=512)
    drafter.draft_cost = lambda k: 0.0
    eng = tiny_engine(SpeculativeConfig("draft_model", model="tiny", num_speculative_tokens=3), drafter,
                      max_model_len=512)
    eng.cost.time = lambda width: 0.010 + 0.001 * width
    eng.policy.news = 16  # past the first steps' exploring
    seen, real = [], eng.policy.lengths

    def lengths(seqs, limits, extra_width=0):
        age = eng.cost.age(1)
        ks = real(seqs, limits, extra_width)
        seen.append((age, ks[0], limits[0]))
        return ks

    eng.policy.lengths = lengths
    assert run_all(eng, [prompt], params) == [plain]
    probes = [age for age, k, limit in seen if k == 0 and limit >= 3]
    assert 1 <= len(probes) <= 2 and all(age >= 54 for age in probes), seen
    assert max(age for age, _, _ in seen) <= 54 + 1  # the probe's own pass re-timed one row
