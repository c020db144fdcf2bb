"""Chained drafters: config validation at start-up, the first proposal wins, every drafter stays
in step with the target, and the chain is lossless (greedy and sampled)."""

from __future__ import annotations

import json
import random

import pytest

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.errors import SpecserveError
from specserve.speculative.chain import ChainDrafter
from specserve.speculative.config import SpeculativeConfig, parse_speculative_config
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.suffix import SuffixDrafter
from test_suffix import _seq

SUFFIX = {"method": "suffix"}
DRAFT = {"method": "draft_model", "model": "smollm2-135m", "quantization": "int8"}


def test_chain_config_inherits_and_bounds_draft_lengths():
    spec = parse_speculative_config(json.dumps({"method": "chain", "num_speculative_tokens": 8,
                                         "drafters": [SUFFIX, dict(DRAFT, num_speculative_tokens=3)]}))
    assert spec.method == "chain" and spec.num_speculative_tokens == 8 and spec.adaptive
    assert [(d.method, d.num_speculative_tokens) for d in spec.drafters] == [("suffix", 8), ("draft_model", 3)]
    spec = parse_speculative_config({"method": "chain", "adaptive": False,
                              "drafters": [dict(SUFFIX, num_speculative_tokens=12), {"method": "ngram"}]})
    assert spec.num_speculative_tokens == 12 and not spec.adaptive  # the largest of its drafters'
    assert [d.num_speculative_tokens for d in spec.drafters] == [12, 5]
    suffix = parse_speculative_config('{"method": "suffix", "suffix_decoding_max_tree_depth": 32, '
                               '"suffix_decoding_min_token_prob": 0.2, "suffix_decoding_max_spec_factor": 2}')
    assert (suffix.suffix_decoding_max_tree_depth, suffix.suffix_decoding_min_token_prob) == (32, 0.2)


@pytest.mark.parametrize("bad,says", [
    ({"method": "chain"}, "non-empty \"drafters\""),
    ({"method": "chain", "drafters": []}, "non-empty \"drafters\""),
    ({"method": "chain", "drafters": [{"method": "eagle"}]}, r"drafters\[0\]: method 'eagle' is not one of"),
    ({"method": "chain", "drafters": [SUFFIX, {"method": "chain", "drafters": [SUFFIX]}]},
     r"drafters\[1\]: a chain inside a chain"),
    ({"method": "chain", "drafters": [SUFFIX, SUFFIX]}, "appears twice"),
    ({"method": "chain", "num_speculative_tokens": 4, "drafters": [dict(SUFFIX, num_speculative_tokens=8)]},
     "num_speculative_tokens 8, more than the chain's 4"),
    ({"method": "chain", "drafters": [dict(SUFFIX, adaptive=False)]}, "\"adaptive\" is set on the chain"),
    ({"method": "chain", "model": "x", "drafters": [SUFFIX]}, "'model' belongs in one of the chain's"),
    ({"method": "chain", "drafters": ["suffix"]}, r"drafters\[0\]: must be a JSON object"),
    ({"method": "chain", "drafters": [{"method": "ngram", "colour": 1}]}, r"drafters\[0\]: unknown key 'colour'"),
    ({"method": "chain", "drafters": [{"method": "draft_model"}]}, r"drafters\[0\]: method 'draft_model' needs"),
    ({"method": "chain", "drafters": "suffix"}, "'drafters' must be list"),
    ({"method": "ngram", "drafters": [SUFFIX]}, "applies to method \"chain\" only"),
    ({"method": "ngram", "suffix_decoding_max_tree_depth": 8}, "applies to method \"suffix\" only"),
    ({"method": "suffix", "model": "x"}, "do not apply to method \"suffix\""),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, r"must be in \[0, 1\]"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, r"must be in \[1, 1024\]"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, ">= 0"),
    ({"method": "suffix", "draft_p_min": 0.5}, "suffix_decoding_min_token_prob"),
])
def test_bad_chain_and_suffix_configs_are_named(bad, says):
    with pytest.raises(SpecserveError, match=says):
        parse_speculative_config(json.dumps(bad))


def test_a_bad_chain_fails_at_start_up_before_loading_anything(capsys):
    from specserve.cli import main

    argv = ["generate", "--speculative-config", '{"method": "chain", "drafters": [{"method": "suffix"}, '
                                                '{"method": "chain", "drafters": []}]}', "hi"]
    assert main(argv) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "chains do not nest" in err[0], err


class Recording:
    """A real drafter with its calls recorded."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.name, self.hidden_layers, self.has_cost = inner.name, inner.hidden_layers, inner.has_cost

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def propose(self, seqs, ks):
        self.calls.append(("propose", [s.request_id for s in seqs], list(ks)))
        return self.inner.propose(seqs, ks)

    def on_verified(self, seq, n):
        self.calls.append(("verified", seq.request_id, n))

    def on_finished(self, seq):
        self.calls.append(("finished", seq.request_id))
        self.inner.on_finished(seq)


def test_first_drafter_with_a_proposal_wins_per_sequence():
    code = list(range(100, 130))
    repeats = _seq(code + [1] + code[:6], rid="copy")  # the suffix tree has a long match
    ngram_only = _seq([5, 7, 9, 3, 5], rid="short")  # a 1-token match: suffix's 0.5 factor says no
    nothing = _seq([1, 2, 3, 4], rid="new")
    suffix = Recording(SuffixDrafter(max_cached_requests=0, max_spec_factor=0.5))
    ngram = Recording(NgramDrafter(1, 3))
    chain = ChainDrafter([suffix, ngram], [6, 2])
    props = chain.propose([repeats, ngram_only, nothing], [5, 5, 0])
    assert props[0].token_ids == code[6:9]  # 6 matched * 0.5
    assert props[1].token_ids == [7, 9]  # from ngram, capped at its 2
    assert props[2].token_ids == []
    assert suffix.calls == [("propose", ["copy", "short"], [5, 5])]  # a sequence at k = 0 asks nobody
    assert ngram.calls == [("propose", ["short"], [2])]  # only what suffix left
    assert chain.wins == [1, 1]
    for s in (repeats, ngram_only, nothing):
        chain.on_verified(s, 1)
        chain.on_finished(s)
    for rec in (suffix, ngram):  # everyone hears about every sequence
        assert [c for c in rec.calls if c[0] != "propose"] == [
            ("verified", "copy", 1), ("finished", "copy"), ("verified", "short", 1), ("finished", "short"),
            ("verified", "new", 1), ("finished", "new")]


def test_a_drafter_seldom_right_for_a_sequence_yields_to_the_next():
    """A first drafter whose drafts verification keeps rejecting is skipped for that sequence
    (the next drafter proposes), asked again every PROBE_EVERY-th step, and back in front once
    its drafts are accepted; other sequences keep their own record."""
    from specserve.speculative.chain import MIN_ACCEPT, PROBE_EVERY

    first, second = Recording(NgramDrafter(1, 3)), Recording(SuffixDrafter(max_cached_requests=0))
    chain = ChainDrafter([first, second], [3, 3])
    code = list(range(100, 130))
    seq, other = _seq(code + [1] + code[:8], rid="a"), _seq(code + [1] + code[:8], rid="b")
    asked_first = []
    for step in range(3 * PROBE_EVERY):
        first.calls.clear()
        chain.propose([seq], [3])
        asked_first.append(bool(first.calls))
        chain.on_verified(seq, 0)  # every draft rejected
    assert asked_first[:4] == [True] * 4  # until its accepted share falls under MIN_ACCEPT
    later = asked_first[PROBE_EVERY:]
    assert later.count(True) == 2 and all(later[k] == (k % PROBE_EVERY == 0) for k in range(len(later)))
    assert chain.wins[1] > 0 and seq.drafter_state["chain"].accept[0] < MIN_ACCEPT
    first.calls.clear()
    chain.propose([other], [3])
    assert first.calls  # a new sequence starts with the first drafter in front
    st = seq.drafter_state["chain"]
    while st.steps % PROBE_EVERY:
        chain.propose([seq], [3])
        chain.on_verified(seq, 0)
    for _ in range(4):  # probes whose drafts are all accepted bring it back
        chain.propose([seq], [3])
        chain.on_verified(seq, 3)
    first.calls.clear()
    chain.propose([seq], [3])
    assert first.calls and st.accept[0] >= MIN_ACCEPT
    chain.on_finished(seq)
    assert "chain" not in seq.drafter_state


def test_chain_cost_is_what_runs():
    """draft_cost weights each drafter's cost by how often some sequence falls through to it."""

    class Costly(NgramDrafter):
        name, has_cost = "costly", True

        def draft_cost(self, k):
            return 0.01 * k

    code = list(range(100, 130))
    chain = ChainDrafter([SuffixDrafter(max_cached_requests=0), Costly(1, 3)], [8, 4])
    assert chain.has_cost and chain.draft_cost(8) == pytest.approx(chain.drafters[0].draft_cost(8) + 0.04)
    for _ in range(60):  # the suffix drafter always has a proposal: the costly one never runs
        chain.propose([_seq(code + [1] + code[:8])], [8])
    assert chain.rates[1] < 0.01 and chain.draft_cost(8) < chain.drafters[0].draft_cost(8) + 0.0004
    for _ in range(60):  # now it runs every step (and finds nothing either)
        chain.propose([_seq([1, 2, 3, 4])], [8])
    assert chain.rates[1] > 0.99 and chain.draft_cost(8) == pytest.approx(0.04, rel=0.02, abs=1e-3)
    with pytest.raises(ValueError, match="must differ"):
        ChainDrafter([NgramDrafter(), NgramDrafter()], [4, 4])


# ---- in the engine (tiny models) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from drafter_utils import random_drafter
    from tiny_models import make_tiny_target
    from specserve.speculative.drafter_files import save_drafter

    tiny = make_tiny_target(tmp_path_factory.mktemp("tiny_chain"))
    draft = make_tiny_target(tmp_path_factory.mktemp("tiny_chain_draft"), seed=1, layers=1)
    m = random_drafter(tiny, block_size=4)
    where = tmp_path_factory.mktemp("chain_dflash")
    save_drafter(m, m.cfg.to_json(), where)
    return tiny, draft, where


def _chain_engine(tiny, drafters, k=4, max_num_seqs=4, adaptive=False, prefix_caching=True):
    spec = SpeculativeConfig("chain", num_speculative_tokens=k, adaptive=adaptive,
                      drafters=tuple(SpeculativeConfig(d.name, model=None if d.name in ("suffix", "ngram") else "x",
                                                num_speculative_tokens=k) for d in drafters))
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256, block_size=8,
                        enable_prefix_caching=prefix_caching)
    return LLMEngine(tiny, ecfg, spec, ChainDrafter(drafters, [k] * len(drafters)))


def _logged(drafter, log):
    """Record (anchor position, tokens so far, drafts) of every proposal a drafter makes."""
    propose = drafter.propose

    def wrapped(seqs, ks):
        props = propose(seqs, ks)
        log.extend((tuple(s.token_ids), p.token_ids) for s, k, p in zip(seqs, ks, props) if k > 0)
        return props
    drafter.propose = wrapped
    return drafter


def _prompts():
    rnd = random.Random(3)
    unit = [rnd.randrange(256) for _ in range(5)]
    return [(unit * 5)[:n] + [rnd.randrange(256) for _ in range(m)] for n, m in ((12, 3), (20, 0), (7, 9), (3, 2))]


def _model_drafter(kind, models, store=None):
    from specserve.speculative.dflash import DFlashDrafter
    from specserve.speculative.draft_model import DraftModelDrafter

    tiny, draft, where = models
    if kind == "draft_model":
        return DraftModelDrafter(draft, 200, 8, 256)
    return DFlashDrafter.load(where, tiny, weights="int8", store=store)  # batch-invariant kernels


@pytest.mark.parametrize("first,second", [("suffix", "draft_model"), ("ngram", "dflash"), ("suffix", "dflash")])
def test_model_drafter_in_a_chain_stays_in_step(models, first, second):
    """Greedy output equals plain; the model drafter, which proposes only when the first drafter
    has nothing, drafts at every such point exactly what it drafts there when it runs alone
    (its KV / context cache kept up to date on the steps it sat out); nothing leaks."""
    from engine_utils import run_all
    from specserve.speculative.prefix_store import PrefixStore

    tiny = models[0]
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = run_all(LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=8)), prompts, greedy)
    alone_log, chain_log = [], []
    alone = _logged(_model_drafter(second, models, PrefixStore(64, 8)), alone_log)
    spec = SpeculativeConfig(second, num_speculative_tokens=3, model="x", adaptive=False)
    eng = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=8), spec, alone)
    assert run_all(eng, prompts, greedy) == plain
    # picky first drafters, so that the model drafter gets its turn often
    head = SuffixDrafter(min_token_prob=0.9, max_spec_factor=0.34) if first == "suffix" else NgramDrafter(3, 4)
    model = _logged(_model_drafter(second, models, PrefixStore(64, 8)), chain_log)
    eng = _chain_engine(tiny, [head, model], k=3)
    for _ in range(2):  # twice: the second time with prefix-cache hits (and suffix's cached outputs)
        assert run_all(eng, prompts, greedy) == plain
    wins = eng.drafter.wins
    assert wins[0] > 0 and wins[1] > 0, wins  # both drafters supplied proposals
    alone_at = dict(alone_log)
    shared = [(ctx, drafts) for ctx, drafts in chain_log if ctx in alone_at]
    assert len(shared) >= 10, (len(shared), len(chain_log), len(alone_log), wins)
    assert all(alone_at[ctx] == drafts for ctx, drafts in shared)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    if second == "draft_model":
        assert model.blocks.num_free == model.blocks.num_blocks


def test_chain_sampling_keeps_the_target_distribution(models):
    """At temperature > 0, suffix drafts (point masses) where the request or the earlier outputs
    repeat, the draft model's sampled drafts (with probabilities) elsewhere: the first three
    tokens' joint distribution is the target's exact one."""
    from test_suffix import sampled_joint_pvalue

    tiny = models[0]
    eng = _chain_engine(tiny, [SuffixDrafter(min_token_prob=0.3, max_cached_requests=64),
                               _model_drafter("draft_model", models)], k=3, max_num_seqs=32)
    assert sampled_joint_pvalue(eng, tiny, [11, 12, 13, 14] * 5, 1000, seed0=5000) > 0.001
    t = eng.totals
    assert 0 < t.accepted_tokens < t.draft_tokens, t
    assert all(w > 0 for w in eng.drafter.wins), eng.drafter.wins
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_chain_needs_no_catch_up_while_one_of_its_drafters_reads_as_it_goes():
    """The policy weighs what a drafter must first read of a long prompt (Drafter.unread): a chain
    with a model-free drafter can draft without it, so its unread is the least of its drafters'."""

    class Lazy(NgramDrafter):  # stands in for a draft model that has not read the prompt
        name = "lazy"

        def unread(self, seq):
            return seq.num_tokens

    s = _seq(list(range(100, 400)), rid="long")
    assert ChainDrafter([SuffixDrafter(), Lazy(1, 3)], [4, 4]).unread(s) == 0
    assert ChainDrafter([Lazy(1, 3)], [4]).unread(s) == 300
