"""The scheduler and the step's order (schedule -> propose -> forward -> verify -> commit), on a
tiny in-process model."""

from __future__ import annotations

from engine_utils import run_all
from specserve.engine.model_runner import logit_rows
from specserve.engine.scheduler import ScheduledRow, Scheduler
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
