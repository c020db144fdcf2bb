"""A draft model far behind a sequence reads a window of it (``draft_window``): the first
SINK_TOKENS tokens and the last ``window`` or a little more (its start on a grid), numbered on from
the first. The output stays the target's (greedy and sampled, batched); the drafts are the draft
model's own on that view; the view's blocks are found again in the prefix cache, by the same request
and by a conversation's next turn; a slide takes the start leaving least to read; the catch-up the
policy prices is what the slide will read."""

from __future__ import annotations

import random

import pytest

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.errors import SpecserveError
from specserve.speculative.config import SpeculativeConfig, parse_speculative_config
from specserve.speculative.draft_model import SINK_TOKENS, DraftModelDrafter

WINDOW = 64
ECFG = dict(max_num_seqs=3, max_model_len=256, block_size=8)
GRID = WINDOW // 4  # a view's skip: a multiple of a quarter window (of whole blocks)


def _skip(n: int) -> int:
    """The skip of a slide at sequence length n with nothing cached: the latest on the grid."""
    return (n - SINK_TOKENS - WINDOW) // GRID * GRID


class Logged(DraftModelDrafter):
    """Records each proposal: (context, the state's skip, drafts) and the prefix hits of each slide."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[tuple[tuple[int, ...], int, list[int]]] = []
        self.slides: list[int] = []

    def propose(self, seqs, num_tokens):
        props = super().propose(seqs, num_tokens)
        self.log += [(tuple(s.token_ids), s.drafter_state[self.name].skip, p.token_ids)
                     for s, k, p in zip(seqs, num_tokens, props) if k]
        return props

    def _slide(self, seq, st):
        super()._slide(seq, st)
        self.slides.append(st.num_computed)


def _prompts() -> list[list[int]]:
    rnd = random.Random(11)
    return [[rnd.randrange(256) for _ in range(n)] for n in (170, 40, 120)]


def _drafter(tiny, window: int = WINDOW) -> Logged:  # the target drafting for itself: only the view differs
    return Logged(tiny, 200, ECFG["block_size"], ECFG["max_model_len"], window=window)


def _run(tiny, drafter, prompts, params, k: int = 4):
    from engine_utils import run_all

    spec = None if drafter is None else SpeculativeConfig("draft_model", num_speculative_tokens=k, adaptive=False,
                                                          model="x")
    eng = LLMEngine(tiny, EngineConfig(**ECFG), spec, drafter)
    out = run_all(eng, prompts, params)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    if drafter is not None:
        assert drafter.blocks.num_free == drafter.blocks.num_blocks
    return out


def test_windowed_draft_keeps_the_targets_output(tiny_target):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = _run(tiny_target, None, _prompts(), params)
    d = _drafter(tiny_target)
    assert _run(tiny_target, d, _prompts(), params) == plain
    by_prompt = {}
    for ctx, skip, _ in d.log:
        by_prompt.setdefault(ctx[:40], []).append((len(ctx), skip))
    short = _prompts()[1]
    assert {skip for _, skip in by_prompt[tuple(short[:40])]} == {0}  # 40 tokens: read whole
    for p in (_prompts()[0], _prompts()[2]):  # the first proposal after the prompt leaves its middle out
        n, skip = by_prompt[tuple(p[:40])][0]
        assert n == len(p) + 1 and skip == _skip(n)
    full = _drafter(tiny_target, window=0)  # reading everything, the target drafting for itself is always right
    assert _run(tiny_target, full, _prompts(), params) == plain
    assert all(skip == 0 for _, skip, _ in full.log)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampling_with_a_windowed_draft_keeps_the_target_distribution(tiny_target, seeded):
    """At temperature > 0: the first three tokens after a prompt the draft reads a window of follow
    the target's exact joint distribution, the drafts sampled with the positions' noise (a seed) or
    verified by rejection sampling with the view's probabilities (none)."""
    from test_suffix import sampled_joint_pvalue

    d = _drafter(tiny_target)
    spec = SpeculativeConfig("draft_model", num_speculative_tokens=3, adaptive=False, model="x")
    eng = LLMEngine(tiny_target, EngineConfig(**dict(ECFG, max_num_seqs=32)), spec, d)
    prompt = _prompts()[2]
    assert sampled_joint_pvalue(eng, tiny_target, prompt, 600, seeded=seeded) > 0.001
    assert d.slides and all(skip for _, skip, _ in d.log)
    t = eng.totals
    assert 0 < t.accepted_tokens < t.draft_tokens, t


def test_windowed_drafts_are_the_draft_models_own_on_its_view(tiny_target):
    """The first drafts after a long prompt are what the draft model, given only the view as its
    prompt, generates: the view's rows sit at positions 0, 1, ... with nothing else in its cache."""
    from engine_utils import run_all

    prompt = _prompts()[0]
    d = _drafter(tiny_target)
    _run(tiny_target, d, [prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    ctx, skip, drafts = d.log[0]  # the prompt and the token its prefill picked
    assert list(ctx[:-1]) == prompt and skip == _skip(len(ctx)) and len(drafts) == 4
    view = list(ctx[:SINK_TOKENS] + ctx[SINK_TOKENS + skip:])
    assert WINDOW <= len(view) - SINK_TOKENS < WINDOW + GRID
    alone = LLMEngine(tiny_target, EngineConfig(**ECFG))
    assert run_all(alone, [view], SamplingParams(max_tokens=4, ignore_eos=True)) == [drafts]


def test_a_view_is_found_again_in_the_prefix_cache(tiny_target):
    d = _drafter(tiny_target)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = _prompts()[0]
    first = _run(tiny_target, d, [prompt], params)
    assert d.slides == [0]
    assert _run(tiny_target, d, [prompt], params) == first
    # every full block of the view but the one holding its last token (left for its logits)
    n = len(prompt) + 1
    assert len(d.slides) == 2 and d.slides[1] == (n - _skip(n) - 1) // 8 * 8


def test_the_next_turn_reads_only_what_is_new(tiny_target):
    """A conversation's next turn (the last prompt, its answer, a new message) slides to the skip
    the last turn's view had, whose blocks (answer included) the prefix cache holds: the draft reads
    the new message, not a new window; the policy is told so (unread); the output stays the target's.
    Past twice the window after the sink, the view slides on to a new skip."""
    from specserve.engine.sequence import Sequence

    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = _prompts()[0]
    d = _drafter(tiny_target)
    [answer] = _run(tiny_target, d, [prompt], params)
    first_skip = d.log[0][1]
    nxt = prompt + answer[:-1] + [7, 8, 9, 10, 11]  # (the answer's last token: not read by the draft)
    seq = Sequence("r", list(nxt), SamplingParams(max_tokens=4), None)
    view_len = len(nxt) - first_skip
    read = d.unread(seq)
    assert read < 16 and d._plan(seq, d._state(seq))[0] == first_skip
    d.on_finished(seq)
    turns = len(d.log)
    assert _run(tiny_target, d, [nxt], params) == _run(tiny_target, None, [nxt], params)
    ctx, skip, _ = d.log[turns]  # the next turn's first proposal (its prompt and one token)
    assert ctx[:-1] == tuple(nxt) and skip == first_skip
    assert d.slides[-1] == view_len - read and view_len - SINK_TOKENS <= 2 * WINDOW
    # the view would pass twice the window: a new skip, nothing cached past the sink
    far = nxt + list(range(2 * WINDOW))
    seq = Sequence("r", list(far), SamplingParams(max_tokens=4), None)
    skip, cached = d._plan(seq, d._state(seq))
    assert skip == _skip(len(far)) > first_skip and cached <= SINK_TOKENS
    d.on_finished(seq)


def test_a_slide_takes_the_view_that_leaves_least_to_read(tiny_target):
    """Of the grid's skips (here 208, 192, 176, 160 for 300 tokens), the one whose view leaves the
    fewest tokens past its cached prefix: not the one with the most cached (160 holds 110 of its 140
    tokens, 192 holds 100 of 108)."""
    from specserve.engine.sequence import Sequence

    d = _drafter(tiny_target)
    held = {160: 110, 176: 16, 192: 100, 208: 16}
    by_view = {}
    seq = Sequence("r", list(range(300)), SamplingParams(max_tokens=4), None)
    for skip, cached in held.items():
        by_view[len(seq.token_ids) - skip] = cached
    d.blocks.cached_prefix = lambda view: by_view.get(len(view), SINK_TOKENS)
    assert d._plan(seq, d._state(seq)) == (192, 100)
    assert d.unread(seq) == 300 - 192 - 100
    by_view.clear()  # nothing past the sink held any more: the latest skip, once the sequence grows
    assert d._plan(seq, d._state(seq)) == (192, 100)  # (a plan is kept until then)
    longer = Sequence("r2", list(range(301)), SamplingParams(max_tokens=4), None)
    assert d._plan(longer, d._state(longer)) == (_skip(301), SINK_TOKENS)


def test_the_catch_up_priced_is_the_window(tiny_target):
    from specserve.engine.sequence import Sequence

    d, whole = _drafter(tiny_target), _drafter(tiny_target, window=0)
    for n in (30, SINK_TOKENS + WINDOW, 170):
        seq = Sequence("r", list(range(n)), SamplingParams(max_tokens=4), None)
        assert d.unread(seq) == (n if n <= SINK_TOKENS + WINDOW else n - _skip(n)) and whole.unread(seq) == n
        d.on_finished(seq)
        whole.on_finished(seq)


def test_draft_window_config():
    spec = parse_speculative_config('{"method": "draft_model", "model": "m", "draft_window": 512}')
    assert spec.draft_window == 512
    assert parse_speculative_config('{"method": "draft_model", "model": "m", "draft_window": 0}').draft_window == 0
    for bad, says in (('{"method": "suffix", "draft_window": 512}', "applies to method \"draft_model\""),
                      ('{"method": "draft_model", "model": "m", "draft_window": 10}', r"0 \(off\) or in \[64"),
                      ('{"method": "draft_model", "model": "m", "draft_window": -1}', r"0 \(off\) or in \[64"),
                      ('{"method": "draft_model", "model": "m", "draft_window": "512"}', "int")):
        with pytest.raises(SpecserveError, match=says):
            parse_speculative_config(bad)


def test_warm_up_times_a_second_wide_forward_where_catch_ups_can_be_wide(tiny_target):
    """Reading whole prompts (or a window past 2 x CATCH_UP_ROWS), start-up times forwards of
    CATCH_UP_ROWS and twice that, so wide_time can see attention's growth; a 512-token window needs one."""
    from specserve.engine.sequence import Sequence
    from specserve.speculative.draft_model import CATCH_UP_ROWS

    def scratch(width=None):
        return Sequence("warm", [1] * (width or 8), SamplingParams(max_tokens=4), None)

    for window, widths in ((0, [CATCH_UP_ROWS, 2 * CATCH_UP_ROWS]), (2048, [CATCH_UP_ROWS, 2 * CATCH_UP_ROWS]),
                           (512, [CATCH_UP_ROWS])):
        d = DraftModelDrafter(tiny_target, 400, 8, 2048, window=window)
        d.warm_up(scratch)
        assert sorted(r for r, _ in d.wide.values()) == widths, window
        assert d.blocks.num_free == d.blocks.num_blocks
