"""Adaptive draft length: the per-width cost model, start-up calibration and the policy's choices."""

from engine_utils import make_engine
from specserve.engine.sequence import Sequence
from specserve.engine.types import SamplingParams
from specserve.speculative.adaptive import (COST_PROBE_BUDGET, COST_PROBE_MAX, COST_PROBE_MIN, PRIOR_EVIDENCE,
                                            PROBE_BUDGET, PROBE_MAX, AnswerLengths, CostModel, DraftPolicy,
                                            calibrate)


def _seq(accept: float) -> Sequence:
    s = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=64), None)
    s.accept_ema = accept
    return s


def test_cost_model_keeps_a_time_per_width_and_interpolates():
    c = CostModel(max_width=16)
    assert c.time(3) == c.a + 3 * c.b  # nothing measured yet
    for w, t in ((1, 0.010), (2, 0.011), (4, 0.013), (8, 0.030)):
        c.add(w, t)
    assert c.time(2) == 0.011
    assert abs(c.time(3) - 0.012) < 1e-12  # between its neighbours
    assert abs(c.time(6) - 0.0215) < 1e-12
    assert abs(c.time(10) - (0.030 + 2 * (0.030 - 0.013) / 4)) < 1e-12  # the slope of the widest two
    c.add(200, 5.0)  # a prefill chunk says nothing about verification widths
    assert 200 not in c.table
    c.add(2, 0.021)  # running average
    assert abs(c.time(2) - (0.75 * 0.011 + 0.25 * 0.021)) < 1e-12


def test_cost_model_never_extrapolates_downwards():
    c = CostModel()
    c.add(1, 0.020)
    c.add(2, 0.019)  # noise: wider measured faster
    assert c.time(5) == 0.019


def test_calibrate_times_every_width_interleaved():
    calls = []
    c = CostModel()
    calibrate(c, calls.append, [1, 2, 3], rounds=2)
    assert calls == [1, 1, 2, 3, 1, 2, 3]  # one warm-up, then the rounds
    assert sorted(c.table) == [1, 2, 3]


def test_calibrate_keeps_the_fastest_round():
    """A round slowed by other work on the machine does not set a width's cost."""
    import time

    rounds = []

    def run(width: int) -> None:
        rounds.append(width)
        if width == 2 and rounds.count(2) == 1:  # the first round of width 2 is interrupted
            time.sleep(0.3)

    c = CostModel()
    calibrate(c, run, [1, 2], rounds=3)
    assert c.table[2] < 0.15


def _policy(step: float, draft: float, k_max: int = 8) -> DraftPolicy:
    c = CostModel()
    for w in range(1, k_max + 2):
        c.add(w, 0.030 + step * (w - 1))
    p = DraftPolicy(k_max, True, c)
    p.draft_cost = lambda k: draft * k
    p._step = 1  # not a probe step
    p.news = PRIOR_EVIDENCE  # past the first steps' exploring
    return p


def test_policy_drafts_nothing_when_drafting_costs_more_than_it_yields():
    p = _policy(step=0.010, draft=0.020)
    assert p.lengths([_seq(0.3)], [8]) == [0]


def test_policy_drafts_more_when_drafts_are_cheap_and_accepted():
    cheap = _policy(step=0.001, draft=0.002)
    assert cheap.lengths([_seq(0.9)], [8]) == [8]
    dear = _policy(step=0.001, draft=0.010)
    k = dear.lengths([_seq(0.9)], [8])[0]
    assert 1 <= k < 8
    assert cheap.lengths([_seq(0.9)], [3]) == [3]  # capped by the tokens left


def test_policy_sees_a_block_drafter_pay_one_forward_for_any_k():
    p = _policy(step=0.001, draft=0.0)
    p.draft_cost = lambda k: 0.040  # e.g. dflash: one forward whatever k
    assert p.lengths([_seq(0.5)], [7]) == [0]  # 1.5 tokens for 0.071 s is worse than 1 for 0.030
    assert p.lengths([_seq(0.95)], [7]) == [7]  # once it pays, the whole block


def test_cost_model_counts_passes_since_a_width_was_timed():
    c = CostModel(max_width=16)
    assert c.age(1) is None
    c.add(1, 0.02)
    c.add(5, 0.03)
    c.add(200, 1.0)  # not a width the table keeps: not counted
    c.add(5, 0.03)
    assert (c.age(1), c.age(5), c.timed) == (2, 0, 3)


def test_a_width_timed_before_the_latest_one_row_time_follows_it():
    """Plain decoding after a long prompt re-times one row only: the widths measured before keep
    their start-up times unless scaled by how one row moved since; a width measured again is its own."""
    c = CostModel(max_width=16)
    for w, t in ((1, 0.020), (2, 0.021), (4, 0.024)):
        c.add(w, t)
    for _ in range(40):
        c.add(1, 0.030)  # longer context: one row costs more
    ratio = c.table[1] / 0.020
    assert abs(c.time(4) - 0.024 * ratio) < 1e-12 and abs(c.time(3) - 0.0225 * ratio) < 1e-12
    c.add(4, 0.034)
    assert c.time(4) == c.table[4] and abs(c.time(2) - 0.021 * ratio) < 1e-12


def test_after_a_long_prompt_the_catch_up_rule_does_not_turn_as_one_row_grows():
    """A plain answer after a long prompt: the one-row time climbs with the context, step by step.
    With the verification widths following it, a catch-up that cannot be repaid stays unrepaid."""
    cost = CostModel()
    for w in range(1, 7):
        cost.add(w, 0.020 + 0.0005 * (w - 1))  # start-up, at a short context
    p = DraftPolicy(5, True, cost, draft_cost=lambda k: 0.005 * k, catch_up_cost=lambda n: 0.4,
                    unread=lambda seq: 600)
    p.news = PRIOR_EVIDENCE
    seq = _seq(0.5)
    said = []
    for left in range(62, 30, -1):
        said.append(p.lengths([seq], [left])[0])
        cost.add(1, 0.020 + 0.0005 * (62 - left))  # each plain step a little dearer
    assert not any(said)


def _drafting(p: DraftPolicy, seq: Sequence, steps: int, width=lambda k: k + 1) -> list[int]:
    """ks over ``steps`` steps, each step's pass timed back into the cost model at its old time."""
    ks = []
    for _ in range(steps):
        k = p.lengths([seq], [8])[0]
        p.cost.add(width(k), p.cost.time(width(k)))
        ks.append(k)
    return ks


def test_a_drafting_sequence_re_times_the_plain_width_now_and_then():
    """A drafting engine seldom runs one-row forwards, so the one-row time would stay as start-up
    measured it; every so often a step decodes plain instead, as rarely as keeps the loss within
    COST_PROBE_BUDGET of decode time (and at least every COST_PROBE_MAX passes)."""
    p = _policy(step=0.001, draft=0.002)
    ks = _drafting(p, _seq(0.9), 400)
    plain = [i for i, k in enumerate(ks) if k == 0]
    # 8 drafts: 0.038 + 0.016 s for 1 + .9 + ... + .9^8 tokens; a plain step loses 0.030 s less the
    # drafting steps' time for one token
    tokens = sum(0.9 ** j for j in range(9))
    loss, step = 0.030 - 0.054 / tokens, 0.054
    every = max(COST_PROBE_MIN, -(-loss // (COST_PROBE_BUDGET * step)))
    assert plain and all(b - a == every + 1 for a, b in zip(plain, plain[1:]))  # (the probe's own pass)
    assert set(ks) == {0, 8}
    # a plain time found stale moves the choice: probes timed it at 0.010 s, not the 0.030 it was
    p2 = _policy(step=0.001, draft=0.010)
    seq = _seq(0.6)
    before = p2.lengths([seq], [8])[0]
    for _ in range(9):
        p2.cost.add(1, 0.010)
    assert 0 < before and p2.lengths([seq], [8]) == [0]


def test_cost_probes_stay_within_their_bounds():
    p = _policy(step=0.001, draft=0.0)
    p.cost.add(1, 0.500)  # a one-row time far above the drafting steps': the loss caps the interval at the most
    assert p._cost_probe_due(1, 0.004, 0.040) is False  # measured just now
    p.cost.timed += COST_PROBE_MAX - 1
    assert not p._cost_probe_due(1, 0.004, 0.040)
    p.cost.timed += 1
    assert p._cost_probe_due(1, 0.004, 0.040)
    q = _policy(step=0.001, draft=0.0)  # plain as fast as drafting: no loss, the shortest interval
    q.cost.timed += COST_PROBE_MIN
    assert q._cost_probe_due(1, 0.040, 0.040) and not q._cost_probe_due(30, 0.040, 0.040)  # (never timed)
    fixed = DraftPolicy(8, False, q.cost)  # a fixed k never probes
    assert fixed.lengths([_seq(0.9)], [8]) == [8]


def test_engine_calibrates_the_verification_widths_at_start():
    spec = '{"method": "draft_model", "model": "smollm2-135m", "quantization": "q4_0", "num_speculative_tokens": 3}'
    engine = make_engine("--model", "smollm2-135m", "--speculative-config", spec)
    assert sorted(engine.cost.table) == [1, 2, 3, 4]
    assert 1 in engine.drafter.cost.table  # the draft model's own step
    assert engine.blocks.num_free == engine.blocks.num_blocks  # the scratch sequences left nothing behind
    assert engine.drafter.blocks.num_free == engine.drafter.blocks.num_blocks
    engine.drafter.cost.table.update({1: 0.004, 8: 0.010})  # the catch-up cost comes from its own timings
    assert engine.policy.catch_up_cost(1) == 0.0 and abs(engine.policy.catch_up_cost(8) - 0.006) < 1e-12
    fixed = make_engine("--model", "smollm2-135m", "--speculative-config",
                        spec.replace('"num_speculative_tokens"', '"adaptive": false, "num_speculative_tokens"'))
    assert not fixed.cost.table  # nothing to choose: no start-up timing


def test_probes_are_rarer_for_an_expensive_drafter():
    cheap = _policy(step=0.010, draft=0.0)  # model-free (ngram), but a wider forward costs
    dear = _policy(step=0.010, draft=0.0)
    dear.draft_cost = lambda k: 0.030  # a block drafter: one target forward's worth per probe
    probes = {}
    for name, p in (("cheap", cheap), ("dear", dear)):
        p._step = 0
        probes[name] = sum(p.lengths([_seq(0.05)], [7])[0] for _ in range(400))
    assert probes["cheap"] == 400 // 8  # k = 0 but one draft every 8 steps, to keep learning
    assert probes["dear"] == 400 // 34  # 0.030 / (3% of 0.030 s) = 34 steps between probes


def test_a_draft_models_catch_up_stretches_the_probes():
    """A draft model reads lazily: probing after p steps at k = 0 first runs it over the p tokens
    it skipped. With that counted, probes stay within the budget or stop at PROBE_MAX."""
    p = _policy(step=0.010, draft=0.0)
    p.draft_cost = lambda k: 0.010 * k  # a third of the target's 0.030 s step
    assert p._probe_every(1) == 12  # 0.010 / (3% of 0.030 s)
    p.catch_up_cost = lambda n: 0.0002 * n  # cheap per token: a longer interval pays for it
    every = p._probe_every(1)
    assert 12 < every < PROBE_MAX
    assert 0.010 + p.catch_up_cost(every) <= PROBE_BUDGET * 0.030 * every
    p.catch_up_cost = lambda n: 0.002 * n  # dearer per token than 3% of a step: rarely as allowed
    assert p._probe_every(1) == PROBE_MAX
    p._step = 0
    assert sum(p.lengths([_seq(0.05)], [7])[0] for _ in range(600)) == 600 // PROBE_MAX


def test_acceptance_estimate_counts_a_cut_draft_as_a_miss():
    """draft_p_min cuts a draft at an unsure token: the position not drafted counts as a rejection
    (the estimate is the chance that one more draft yields one more token); a draft cut to nothing
    lowers the estimate too, where it used to leave it as it was."""
    s = _seq(0.5)
    DraftPolicy.update(s, 0, 0)  # nothing asked for: no news
    assert s.accept_ema == 0.5
    DraftPolicy.update(s, 3, 3)  # all three kept: 3 of 3
    assert abs(s.accept_ema - (0.7 * 0.5 + 0.3)) < 1e-12
    s.accept_ema = 0.5
    DraftPolicy.update(s, 2, 2, cut=True)  # two kept, then cut: 2 of 3
    assert abs(s.accept_ema - (0.7 * 0.5 + 0.3 * 2 / 3)) < 1e-12
    s.accept_ema = 0.5
    DraftPolicy.update(s, 0, 0, cut=True)  # cut to nothing: 0 of 1
    assert abs(s.accept_ema - 0.35) < 1e-12


def test_pick_tokens_reports_the_cut():
    import torch

    from specserve.speculative.drafter import pick_tokens

    sure, unsure = torch.tensor([0.0, 9.0, 0.0]), torch.zeros(3)  # top probability ~1 and 1/3
    for params in (SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, presence_penalty=0.5),
                   SamplingParams(max_tokens=8, temperature=1.0, seed=1)):
        seq = Sequence("s", [0, 1, 2], params, None)
        gen = torch.Generator().manual_seed(0)
        full = pick_tokens(seq, torch.stack([sure, sure]), gen, p_min=0.5)
        assert len(full.token_ids) == 2 and not full.cut
        part = pick_tokens(seq, torch.stack([sure, unsure, sure]), gen, p_min=0.5)
        assert len(part.token_ids) == 1 and part.cut
        assert not pick_tokens(seq, torch.stack([unsure, sure]), gen).cut  # no p_min: never cut


def test_a_new_sequence_starts_from_the_running_acceptance_of_those_before_it():
    """Before any step a new sequence starts at 0.5; after many steps whose drafts were mostly
    accepted, a new sequence starts near that share (a costly draft model that is usually right
    drafts from a request's first step, not after rare probes); rejections bring it back down."""
    p = DraftPolicy(8, True, CostModel(), draft_cost=lambda k: 0.004 * k)
    fresh = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=64), None)
    p.lengths([fresh], [8])
    assert fresh.accept_ema == 0.5
    old = _seq(0.5)
    for _ in range(100):
        p.learn(old, 4, 3)  # 3 of 4 accepted: a share of 0.75 a step
    assert abs(p.prior - 0.75) < 0.01
    p.learn(old, 0, 0)  # no news: the prior stays
    assert abs(p.prior - 0.75) < 0.01
    new = Sequence("b", [1, 2, 3], SamplingParams(max_tokens=64), None)
    p.lengths([new], [8])
    assert new.accept_ema == p.prior
    for _ in range(100):
        p.learn(old, 2, 0)
    assert p.prior < 0.05
    late = Sequence("c", [1, 2, 3], SamplingParams(max_tokens=64), None)
    assert p.lengths([late], [8]) == [0] and late.accept_ema < 0.05


def test_a_new_engine_drafts_one_token_until_it_has_seen_its_drafter():
    """At the 0.5 prior these costs say k = 0 (drafting pays from about 0.7). Without evidence the
    policy drafts one token a step anyway, with the prior the plain mean of the shares seen: a good
    drafter's engine goes on to draft for real, a bad one's stops at k = 0 after PRIOR_EVIDENCE steps."""
    assert _policy(step=0.008, draft=0.008).lengths([_seq(0.5)], [8]) == [0]  # (with evidence)
    for share, drafts_after in ((0.9, True), (0.1, False)):
        p = _policy(step=0.008, draft=0.008)
        p.news = 0
        s = _seq(0.5)
        assert p.lengths([_seq(0.5)], [8]) == [1]
        for i in range(PRIOR_EVIDENCE):
            p.learn(s, 1, int(i < share * PRIOR_EVIDENCE))
        assert p.news == PRIOR_EVIDENCE
        assert abs(p.prior - int(share * PRIOR_EVIDENCE + 1) / PRIOR_EVIDENCE) < 1e-9  # the mean of the shares
        new = Sequence("n", [1, 2, 3], SamplingParams(max_tokens=64), None)
        assert (p.lengths([new], [8])[0] > 0) == drafts_after
    capped = _policy(step=0.008, draft=0.008)
    capped.news = 0
    assert capped.lengths([_seq(0.5)], [0]) == [0]  # no room to draft: nothing forced
    capped.catch_up_cost, capped.unread = (lambda n: 10.0), (lambda seq: 2000)
    assert capped.lengths([_seq(0.5)], [8]) == [0]  # a catch-up the answer cannot repay: nothing forced either


def test_a_sequence_drafting_nothing_drifts_back_to_its_own_slow_estimate():
    """Rejections in a row put a sequence at k = 0, where it gets no news (a costly draft model's
    probes come rarely). Steps without news pull its estimate up towards its acceptance over many
    steps: a sequence whose drafts were mostly kept drafts again within a few steps; one whose
    drafts were mostly rejected stays at k = 0; and the pull never lowers an estimate."""
    for history, drafts_again in ((3, True), (0, False)):
        p = _policy(step=0.001, draft=0.008)
        s = _seq(0.5)
        p.lengths([s], [8])
        for _ in range(60):
            p.learn(s, 4, history)  # 3 of 4 kept a step, or none
        for _ in range(4):
            p.learn(s, 4, 0)  # then four rejected in a row
        assert s.accept_ema < 0.3
        ks = []
        for _ in range(6):  # (before the first probe)
            ks.append(p.lengths([s], [8])[0])
            p.learn(s, ks[-1], 0)
        assert ks[0] == 0
        assert (max(ks) > 0) == drafts_again, ks
    s = _seq(0.9)
    s.accept_slow = 0.5
    p.learn(s, 0, 0)
    assert s.accept_ema == 0.9


def test_a_draft_cut_to_nothing_ends_the_drift():
    """A drafter that declined to guess (a draft cut to nothing, draft_p_min) takes the slow estimate
    down to the fast one, so steps without news no longer pull the sequence back to drafting."""
    p = _policy(step=0.001, draft=0.0001)
    s = _seq(0.5)
    p.lengths([s], [8])
    assert s.accept_slow == 0.5
    p.learn(s, 0, 0, cut=True)
    assert s.accept_slow == s.accept_ema < 0.5
    ema = s.accept_ema
    for _ in range(10):
        p.learn(s, 0, 0)  # no news
    assert s.accept_ema == ema


def test_a_long_catch_up_drafts_only_where_the_answer_can_repay_it():
    """A draft model's first proposal reads the whole prompt (one wide forward): after a long
    prompt a short answer decodes plain, a long one drafts; short catch-ups (a sequence back from
    k = 0) are left to the probes, and a fixed k is not second-guessed."""
    cost = CostModel()
    for w, t in ((1, 0.020), (2, 0.021), (3, 0.022), (4, 0.023), (5, 0.030)):
        cost.add(w, t)
    unread = {"long": 2000, "short": 40}
    policy = DraftPolicy(4, True, cost, draft_cost=lambda k: 0.004 * k, catch_up_cost=lambda n: 0.001 * n,
                         unread=lambda s: unread[s.request_id])

    def seq(name: str) -> Sequence:
        s = Sequence(name, [1, 2, 3], SamplingParams(max_tokens=64), None)
        s.accept_ema = s.accept_slow = 0.8
        return s

    # at 0.8 the best k saves ~8 ms a token: 2 s of catch-up needs ~250 tokens left
    assert policy.lengths([seq("long")], [128]) == [0]
    assert policy.lengths([seq("long")], [10000])[0] > 0
    assert policy.lengths([seq("short")], [128])[0] > 0
    fixed = DraftPolicy(4, False, cost, draft_cost=lambda k: 0.004 * k, catch_up_cost=lambda n: 0.001 * n,
                        unread=lambda s: 2000)
    assert fixed.lengths([seq("long")], [128]) == [4]


def test_answer_lengths_say_what_may_follow_and_when_a_catch_up_pays():
    a = AnswerLengths(keep=10)
    assert a.rest(0, 5000) == [5000]  # nothing finished yet: the budget
    assert a.draft_now(0, 5000, 0.01, 1.0)  # 50 s of saving against 1 s
    for n in [0] + [4] * 10 + [400]:  # an empty answer says nothing; the last 10 are kept
        a.add(n)
    assert list(a.seen) == [4] * 9 + [400]
    assert a.rest(0, 100) == [4] * 9 + [100]  # within the budget
    assert a.rest(10, 5000) == [390]  # only the answers that ran past 10 tokens
    assert a.rest(500, 5000) == [500] and a.rest(500, 40) == [40]  # longer than all: as many again
    # the mean (43.6 tokens) x 10 ms > 0.4 s, but waiting 4 tokens spares nine catch-ups for 40 ms
    assert not a.draft_now(0, 5000, 0.01, 0.4)
    assert a.draft_now(4, 5000, 0.01, 0.4)  # past the short ones: the long one's 396 tokens repay it
    assert not a.draft_now(4, 30, 0.01, 0.4)  # unless the budget ends sooner
    assert not a.draft_now(4, 5000, -0.001, 0.0)  # drafting that saves nothing never pays


def test_draft_now_is_the_best_start_over_every_wait():
    """draft_now's one pass over the sorted guesses equals its definition: pay now when a start now is
    worth something and no start after w more tokens (w any guess) is worth more."""
    import random

    def by_definition(a: AnswerLengths, made: int, left: int, saving: float, cost: float) -> bool:
        rest = a.rest(made, left)

        def value(wait: int) -> float:
            return sum(saving * (r - wait) - cost for r in rest if r > wait)

        return value(0) > 0 and all(value(0) >= value(r) for r in rest)

    rng = random.Random(0)
    for _ in range(300):
        a = AnswerLengths()
        for _ in range(rng.randint(0, 70)):
            a.add(rng.choice([rng.randint(1, 10), rng.randint(1, 500)]))
        args = (rng.randint(0, 300), rng.randint(1, 2000), rng.uniform(-0.002, 0.02), rng.uniform(0.0, 1.0))
        assert a.draft_now(*args) == by_definition(a, *args), (list(a.seen), args)


def test_a_long_catch_up_is_weighed_against_the_answers_seen_not_the_budget():
    """A chat request without max_tokens has the rest of the context as budget: after short answers
    have finished, a long prompt's catch-up is weighed against their lengths and the sequence decodes
    plain; a sequence already longer than the answers seen may draft again."""
    cost = CostModel()
    for w, t in ((1, 0.020), (2, 0.021), (3, 0.022), (4, 0.023), (5, 0.030)):
        cost.add(w, t)
    policy = DraftPolicy(4, True, cost, draft_cost=lambda k: 0.004 * k, catch_up_cost=lambda n: 0.001 * n,
                         unread=lambda s: 2000)

    def seq(made: int) -> Sequence:
        s = Sequence("long", [1, 2, 3], SamplingParams(max_tokens=20000), None)
        s.output_ids = [7] * made
        s.accept_ema = s.accept_slow = 0.8
        return s

    assert policy.lengths([seq(0)], [10000])[0] > 0  # nothing finished yet: the budget repays 2 s
    for n in (60, 80, 100):
        policy.finished(seq(n), "stop")
    policy.finished(seq(5000), "abort")  # an abort says nothing of answers' lengths
    assert list(policy.answers.seen) == [60, 80, 100]
    assert policy.lengths([seq(0)], [10000]) == [0]  # ~80 tokens to come cannot repay 2 s
    assert policy.lengths([seq(400)], [10000])[0] > 0  # 400 made: as many again may come


def test_a_draft_models_catch_up_comes_from_its_wide_forwards():
    """Past the cost table's widths a catch-up is read off the wide forwards measured (the latest per
    power of two of rows, a bounded record): linear between the two around it; past them along the
    widest two, bending up as the parabola through the widest three does (attention over a prompt read
    from its start grows as its square), never below the widest."""
    from specserve.speculative.draft_model import wide_time

    pts = [(1, 0.005), (512, 0.371), (1519, 1.35)]
    assert abs(wide_time(pts, 1000) - (0.371 + (1.35 - 0.371) * 488 / 1007)) < 1e-12
    linear = 1.35 + (1.35 - 0.371) * 374 / 1007
    bend = ((1.35 - 0.371) / 1007 - (0.371 - 0.005) / 511) / 1518
    assert abs(wide_time(pts, 1893) - (linear + bend * 374 * 1381)) < 1e-12 and bend > 0
    # an exact parabola is extrapolated exactly; a straight line (or one bending down) stays straight
    assert abs(wide_time([(r, 1e-3 + 2e-4 * r + 1e-7 * r * r) for r in (1, 512, 1024)], 5000) -
               (1e-3 + 2e-4 * 5000 + 1e-7 * 5000 ** 2)) < 1e-12
    assert abs(wide_time([(1, 0.001), (512, 0.5), (1024, 0.9)], 2048) - (0.9 + 0.4 / 512 * 1024)) < 1e-12
    assert abs(wide_time([(1, 0.001), (512, 0.5)], 2048) - (0.5 + 0.499 / 511 * 1536)) < 1e-12
    assert wide_time([(1, 0.005), (512, 0.5), (600, 0.4)], 5000) == 0.4  # noise: wider measured faster
