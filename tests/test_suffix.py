"""Suffix decoding: the suffix tree against brute-force counts, the drafter's proposals, and
losslessness in the engine (greedy equals plain; the sampled distribution is the target's)."""

from __future__ import annotations

import collections
import random
from dataclasses import replace

import pytest

from specserve.engine.config import EngineConfig
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.sequence import Sequence, Status
from specserve.engine.types import SamplingParams
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.suffix import SuffixDrafter
from specserve.speculative.suffix_tree import SuffixTree


def brute_counts(seqs, depth: int) -> dict[tuple[int, ...], int]:
    c: collections.Counter = collections.Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                c[tuple(s[i:i + n])] += 1
    return dict(c)


def rebuilt(seqs: dict, depth: int) -> SuffixTree:
    t = SuffixTree(depth)
    for key, s in seqs.items():
        t.insert(key, s)
    return t


def _random_seq(rnd: random.Random, live: dict) -> list[int]:
    if live and rnd.random() < 0.3:  # a repeated output
        return list(rnd.choice(list(live.values())))
    vocab = rnd.choice([2, 3, 10])
    return [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 30))]


@pytest.mark.parametrize("trial", range(40))
def test_counts_eviction_and_touch_equal_a_rebuild(trial):
    """After every insert, touch and eviction: each substring's count equals a brute-force count
    over the sequences still held, the node count equals a tree built from scratch (the merged
    form is canonical), at most max_sequences are held, the oldest by use go first, and no node
    names a sequence that is gone."""
    rnd = random.Random(trial)
    depth = rnd.choice([1, 2, 3, 5, 8])
    tree, live = SuffixTree(depth), collections.OrderedDict()
    for key in range(rnd.randrange(3, 14)):
        s = _random_seq(rnd, live)
        tree.insert(key, s)
        live[key] = s
        if rnd.random() < 0.3 and len(live) > 1:
            used = rnd.choice(list(live))
            tree.touch(used)
            live.move_to_end(used)
        bound = rnd.randrange(1, 6)
        for gone in tree.evict(bound):
            assert gone == next(iter(live))  # least recently used first
            del live[gone]
        assert len(tree) == len(live) <= bound
        tree.check_invariants()
        assert tree.substring_counts() == brute_counts(live.values(), depth)
        assert tree.num_nodes == rebuilt(live, depth).num_nodes
        assert tree.num_nodes <= 2 * tree.num_tokens
    for _ in range(len(live)):
        tree.evict(len(tree) - 1)
    assert len(tree) == 0 and tree.num_nodes == 0 and tree.root.children is None


@pytest.mark.parametrize("trial", range(20))
def test_incremental_appends_equal_a_rebuild(trial):
    """A sequence grown token by token (the request's own tree) holds, after every token, the
    counts of a tree built from the tokens so far, and its suffix nodes are the places where
    each of its last max_depth suffixes ends."""
    rnd = random.Random(100 + trial)
    depth = rnd.choice([2, 4, 7])
    tree = SuffixTree(depth)
    tree.insert("old", [rnd.randrange(3) for _ in range(20)])
    tree.start("me")
    toks: list[int] = []
    for _ in range(60):
        toks.append(rnd.randrange(rnd.choice([2, 5])))
        tree.append("me", toks[-1])
        tree.check_invariants()
        nodes = tree.suffix_nodes("me")
        assert [n.depth for n in nodes] == list(range(min(depth, len(toks)), 0, -1))
        for n in nodes:
            assert tree.locate(toks[len(toks) - n.depth:]) == (n, n.depth)
    want = rebuilt({"old": tree.seqs["old"], "me": toks}, depth)
    assert tree.substring_counts() == want.substring_counts()
    assert tree.num_nodes == want.num_nodes
    assert tree.evict(0) == ["old"] and len(tree) == 1  # the one being built is never evicted


def brute_continuation(seqs, depth, context, budget, min_prob):
    """Greedy walk over brute-force counts: returns (possible token lists are ambiguous on ties,
    so) the probability of each step and the set of best tokens at each step."""
    counts = brute_counts(seqs, depth)
    ctx, p, steps = list(context), 1.0, []
    while len(steps) < budget and len(ctx) < depth:
        nxt = {t: c for s, c in counts.items() if len(s) == len(ctx) + 1 and list(s[:-1]) == ctx for t in [s[-1]]}
        if not nxt:
            break
        top = max(nxt.values())
        q = p * top / sum(nxt.values())
        if q < min_prob:
            break
        p = q
        steps.append(({t for t, c in nxt.items() if c == top}, p))
        ctx.append(next(iter(steps[-1][0])))
    return steps


@pytest.mark.parametrize("trial", range(30))
def test_continuation_follows_the_most_frequent_branch(trial):
    rnd = random.Random(200 + trial)
    depth = rnd.choice([4, 6, 9])
    # no ties among next tokens, so the greedy path is unique: strongly skewed choices
    seqs = {}
    for key in range(5):
        s = [0]
        for _ in range(40):
            s.append(rnd.choices(range(4), weights=[8, 4, 2, 1])[0] if rnd.random() < 0.5 else (s[-1] + 1) % 4)
        seqs[key] = s
    tree = rebuilt(seqs, depth)
    for _ in range(20):
        src = rnd.choice(list(seqs.values()))
        i, m = rnd.randrange(len(src)), rnd.randrange(1, depth)
        context = src[i:i + m]
        node, d = tree.locate(context)
        assert d == len(context)
        min_prob = rnd.choice([0.0, 0.2, 0.5])
        toks, score, _ = tree.continuation(node, d, depth, min_prob)
        want = brute_continuation(seqs.values(), depth, context, depth, min_prob)
        if all(len(best) == 1 for best, _ in want):
            assert toks == [next(iter(best)) for best, _ in want]
            assert score == pytest.approx(sum(p for _, p in want))
        else:
            assert len(toks) >= 1 and toks[0] in want[0][0]
    assert tree.locate([99]) is None  # a context that never occurred
    assert tree.locate([0] * depth) is None or brute_counts(seqs.values(), depth).get((0,) * depth)


# ---- the drafter --------------------------------------------------------------------------------
def _seq(prompt: list[int], output: list[int] = (), rid: str = "s", params: SamplingParams | None = None) -> Sequence:
    params = params or SamplingParams(max_tokens=64)
    seq = Sequence(rid, list(prompt), params, IncrementalDetokenizer(None, [], ()))
    seq.output_ids = list(output)
    seq.status = Status.RUNNING
    return seq


def _finish(drafter: SuffixDrafter, seq: Sequence) -> None:
    seq.status = Status.FINISHED
    drafter.on_finished(seq)


def test_drafts_continue_an_earlier_occurrence_in_the_request():
    code = list(range(100, 140))
    d = SuffixDrafter(max_depth=24, max_cached_requests=0)
    seq = _seq(code + [7, 8] + code[:10])  # the file again: the rest of it is the draft
    prop = d.propose([seq], [8])[0]
    assert prop.token_ids == code[10:18] and not prop.cut
    seq.output_ids += code[10:13]  # verified tokens join the request's tree incrementally
    assert d.propose([seq], [8])[0].token_ids == code[13:21]
    assert d._state(seq).seen == seq.num_tokens
    assert d.propose([_seq([1, 2, 3, 4, 5])], [4])[0].token_ids == []  # nothing repeats: nothing to say
    assert d.propose([seq], [0])[0].token_ids == []


def test_match_length_bounds_the_draft_and_unsure_branches_cut_it():
    d = SuffixDrafter(max_depth=24, max_cached_requests=0, max_spec_factor=1.0, min_token_prob=0.1)
    seq = _seq([50, 51, 52, 53, 54, 55, 56, 57, 9, 50, 51])  # a 2-token match: at most 2 tokens
    prop = d.propose([seq], [8])[0]
    assert prop.token_ids == [52, 53] and prop.cut  # fewer than asked: the policy sees a cut
    off = SuffixDrafter(max_depth=24, max_cached_requests=0, max_spec_factor=1.0, max_spec_offset=3)
    assert off.propose([_seq(seq.prompt_ids)], [8])[0].token_ids == [52, 53, 54, 55, 56]
    # after [1, 2] came 3 twice, 4 once and 5 once: 3 at 1/2, then certain after [1, 2, 3]
    branches = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1, 2, 5, 0, 1, 2]
    loose = SuffixDrafter(max_depth=8, max_cached_requests=0, max_spec_factor=2.0, min_token_prob=0.4)
    assert loose.propose([_seq(branches)], [3])[0].token_ids == [3, 0, 1]
    strict = SuffixDrafter(max_depth=8, max_cached_requests=0, max_spec_factor=2.0, min_token_prob=0.6)
    prop = strict.propose([_seq(branches)], [3])[0]
    assert prop.token_ids == [] and prop.cut


def test_earlier_outputs_are_drafted_from_and_evicted_least_recently_used():
    d = SuffixDrafter(max_depth=16, max_cached_requests=3)
    answers = {name: [base + i for i in range(20)] for name, base in (("a", 1000), ("b", 2000), ("c", 3000))}
    for name in "ab":
        _finish(d, _seq([1, 2, 3], answers[name], rid=name))
    assert len(d.cache) == 2
    asking = _seq([4, 5], answers["a"][:6], rid="again")  # the same answer begins again
    assert d.propose([asking], [6])[0].token_ids == answers["a"][6:12]  # a 6-token match: 6 tokens
    _finish(d, asking)  # "a" was drafted from: now newer than "b"; then asking's own output is cached
    assert len(d.cache) == 3
    _finish(d, _seq([1], answers["c"], rid="c"))
    assert len(d.cache) == 3
    assert d.propose([_seq([9], answers["b"][:6])], [6])[0].token_ids == []  # "b", least recently used, went
    assert d.propose([_seq([9], answers["a"][:6])], [6])[0].token_ids == answers["a"][6:12]
    assert d.propose([_seq([9], answers["c"][:6])], [6])[0].token_ids == answers["c"][6:12]
    d.cache.check_invariants()


def test_preempted_and_empty_sequences_are_not_cached():
    d = SuffixDrafter(max_depth=8, max_cached_requests=4)
    seq = _seq([1, 2, 3], [4, 5, 6, 1, 2])
    before = d.propose([seq], [3])[0].token_ids
    assert before == [3, 4]  # a 2-token match
    d.on_finished(seq)  # preemption: the sequence is still running, its tree is dropped and rebuilt later
    assert "suffix" not in seq.drafter_state and len(d.cache) == 0
    assert d.propose([seq], [3])[0].token_ids == before
    _finish(d, _seq([1, 2, 3]))
    assert len(d.cache) == 0


# ---- in the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny_suffix"))


def suffix_engine(target, k: int = 4, max_num_seqs: int = 4, **kw) -> LLMEngine:
    spec = SpeculativeConfig("suffix", num_speculative_tokens=k, adaptive=False)
    return LLMEngine(target, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256),
                     spec, SuffixDrafter(**kw))


def test_tiny_greedy_lossless_and_repeats_hit_the_cache(tiny):
    from engine_utils import run_all

    rnd = random.Random(0)
    prompts = [([rnd.randrange(256) for _ in range(6)] * 4)[:n] for n in (9, 17, 24)] + [[7, 8, 9]]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = run_all(LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256)), prompts, greedy)
    eng = suffix_engine(tiny, min_token_prob=0.0)
    assert run_all(eng, prompts, greedy) == plain
    first = eng.totals.accepted_tokens
    assert eng.totals.draft_tokens > 0 and eng.blocks.num_free == eng.blocks.num_blocks
    assert run_all(eng, prompts, greedy) == plain  # again: the earlier outputs are in the cache
    again = eng.totals.accepted_tokens - first
    assert again > first and again > 0.5 * sum(len(p) for p in plain)
    assert len(eng.drafter.cache) == 2 * len(prompts)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def exact_joint(target, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    """The target's exact probability of each first-n-tokens continuation under params (top_k
    small): from the raw top logprobs the engine reports, warped as the sampler warps them."""
    import math

    from engine_utils import run_one

    plain = LLMEngine(target, EngineConfig(max_num_seqs=1, max_model_len=256))
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for ctx, p in out.items():
            _, last = run_one(plain, prompt + list(ctx), SamplingParams(max_tokens=1, logprobs=params.top_k))
            top = last.new_logprobs[0].top[:params.top_k]
            w = [math.exp(lp / params.temperature) for _, lp in top]
            for (tok, _), wi in zip(top, w):
                nxt[ctx + (tok,)] = p * wi / sum(w)
        out = nxt
    return out


DIST = SamplingParams(max_tokens=3, temperature=8.0, top_k=2, ignore_eos=True)  # 8 outcomes, none rare


def sampled_joint_pvalue(engine: LLMEngine, target, prompt: list[int], samples: int, seed0: int = 0,
                         seeded: bool = False) -> float:
    """Sample the first three tokens ``samples`` times (DIST; unseeded requests, verified by
    rejection sampling, each with a generator of its own; ``seeded``: seeds seed0, seed0 + 1, ...,
    which sample by their positions' noise whatever is drafted) and return the chi-square p-value of
    the counts against the target's exact joint distribution."""
    import torch

    from test_verify import chi2_pvalue

    exact = exact_joint(target, prompt, DIST, 3)
    got = collections.Counter()
    for base in range(seed0, seed0 + samples, 64):
        done: dict[str, list[int]] = {}
        for s in range(base, min(base + 64, seed0 + samples)):
            done[f"dist-{s}"] = []
            engine.add_request(f"dist-{s}", prompt, replace(DIST, seed=s if seeded else None))
        left = set(done)
        while left:
            for o in engine.step():
                done[o.request_id] += o.new_token_ids
                if o.finished:
                    left.discard(o.request_id)
        got.update(tuple(v) for v in done.values())
    if not set(got) <= set(exact):  # outcomes the target never produces
        return 0.0
    cells = sorted(exact)
    counts = torch.tensor([float(got[c]) for c in cells], dtype=torch.float64)
    probs = torch.tensor([exact[c] for c in cells], dtype=torch.float64)
    return chi2_pvalue(counts, probs / probs.sum())


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampling_keeps_the_target_distribution(tiny, monkeypatch, seeded):
    """At temperature > 0 the joint distribution of the first three sampled tokens, with suffix
    drafts from the request's own repetitive prompt and from the cached earlier outputs of the
    same prompt, is the target's exact one, verified by the positions' noise (a seed) or by
    rejection sampling (none); the same test fails a verifier that accepts every point-mass draft."""
    import specserve.engine.llm_engine as llm_engine

    prompt = [11, 12, 13, 14] * 5
    eng = suffix_engine(tiny, k=3, max_num_seqs=32, min_token_prob=0.0, max_cached_requests=64)
    assert sampled_joint_pvalue(eng, tiny, prompt, 1000, seeded=seeded) > 0.001
    t = eng.totals
    assert 0 < t.accepted_tokens < t.draft_tokens, t  # drafts were accepted and rejected
    assert eng.blocks.num_free == eng.blocks.num_blocks

    def accept_all(probs, drafts, draft_probs, generator):
        return len(drafts), list(drafts) + [llm_engine.sampler.sample_from(probs[len(drafts)], generator)]

    def accept_all_keyed(probs, drafts, noise, first):
        k = len(drafts)
        return k, list(drafts) + [llm_engine.sampler.sample_at(probs[k], noise.at(first + k, probs.shape[-1]))]
    monkeypatch.setattr(llm_engine, "verify_sampling", accept_all)
    monkeypatch.setattr(llm_engine, "verify_keyed", accept_all_keyed)
    broken = suffix_engine(tiny, k=3, max_num_seqs=32, min_token_prob=0.0, max_cached_requests=64)
    assert sampled_joint_pvalue(broken, tiny, prompt, 300, seeded=seeded) < 0.001
