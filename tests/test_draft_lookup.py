"""A draft model checking prompt lookup's guesses (``draft_lookup_tokens``): its proposals are the
ones it makes without them, token for token and probability for probability, in fewer forwards
where it agrees with the guesses; its KV cache stays right after wrong ones."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.errors import SpecserveError
from specserve.speculative.config import SpeculativeConfig, parse_speculative_config
from specserve.speculative.draft_model import DraftModelDrafter


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny_models import make_tiny_target

    tiny = make_tiny_target(tmp_path_factory.mktemp("tiny_lookup"))
    draft = make_tiny_target(tmp_path_factory.mktemp("tiny_lookup_draft"), seed=1, layers=1)
    return tiny, draft


def _prompts() -> list[list[int]]:
    rnd = random.Random(5)
    unit = [rnd.randrange(256) for _ in range(6)]
    return [(unit * 4)[:n] + [rnd.randrange(256) for _ in range(m)] for n, m in ((14, 3), (22, 0), (5, 9))]


class Logged(DraftModelDrafter):
    """Records every proposal: (context, drafts, draft probabilities)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[tuple[tuple[int, ...], list[int], torch.Tensor | None]] = []

    def propose(self, seqs, num_tokens):
        props = super().propose(seqs, num_tokens)
        self.log += [(tuple(s.token_ids), p.token_ids, p.probs) for s, k, p in zip(seqs, num_tokens, props) if k]
        return props


class Oracle(Logged):
    """Guesses from another run's proposals at the same context, one token in ``wrong_every`` of
    them replaced: right guesses save forwards, wrong ones must leave no trace in the KV cache."""

    def __init__(self, reference: list, wrong_every: int, *a, **kw):
        super().__init__(*a, **kw)
        self.next_of: dict[tuple[int, ...], list[int]] = {}
        for ctx, drafts, _ in reference:
            for j in range(len(drafts)):
                self.next_of[ctx + tuple(drafts[:j])] = drafts[j:]
        self.rnd, self.wrong_every, self.guessed = random.Random(0), wrong_every, 0

    def _guesses(self, context, need):
        guesses = list(self.next_of.get(tuple(context), [])[:need - 1])[:self.lookup]
        for i in range(len(guesses)):
            if self.rnd.randrange(self.wrong_every) == 0:
                guesses[i] = (guesses[i] + 1) % 256
        self.guessed += len(guesses)
        return guesses


def _run(tiny, drafter, params: SamplingParams, k: int = 4) -> list[list[int]]:
    from engine_utils import run_all

    spec = SpeculativeConfig("draft_model", num_speculative_tokens=k, adaptive=False, model="x")
    eng = LLMEngine(tiny, EngineConfig(max_num_seqs=3, max_model_len=256, block_size=8), spec, drafter)
    out = run_all(eng, _prompts(), params)
    assert eng.blocks.num_free == eng.blocks.num_blocks and drafter.blocks.num_free == drafter.blocks.num_blocks
    return out


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=64, ignore_eos=True),
                                    SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.8, seed=3)],
                         ids=["greedy", "sampled"])
def test_guessed_proposals_are_the_draft_models_own(models, params):
    tiny, draft = models
    alone = Logged(draft, 200, 8, 256)
    out = _run(tiny, alone, params)
    for wrong_every in (1000, 3):  # guesses nearly all right, then a third of them wrong
        guided = Oracle(alone.log, wrong_every, draft, 200, 8, 256, lookup=3)
        assert _run(tiny, guided, params) == out
        assert [(c, d) for c, d, _ in guided.log] == [(c, d) for c, d, _ in alone.log]
        for (_, _, p), (_, _, q) in zip(alone.log, guided.log):
            assert (p is None) == (q is None) and (p is None or torch.equal(p, q))  # the same bits
        assert guided.guessed > 0 and guided.num_forwards < alone.num_forwards
        assert guided.num_drafted == alone.num_drafted
        if wrong_every == 1000:  # k = 4 drafts: one forward instead of four where every guess is right
            assert guided.num_forwards < 0.5 * alone.num_forwards, (guided.num_forwards, alone.num_forwards)
            assert guided.forwards_per_token < 0.5
            # the adaptive policy sees the saving: the same (made-up) cost per width, a cheaper k = 4
            for d in (alone, guided):
                d.cost.table = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}
            assert alone.draft_cost(4) == 4.0 and guided.draft_cost(4) < 2.6 and guided.draft_cost(1) == 1.0


def test_prompt_lookup_guesses_on_real_text_and_bad_configs():
    """Guesses come from prompt lookup over the context; the key is checked at start-up."""
    d = DraftModelDrafter.__new__(DraftModelDrafter)
    d.lookup, d.lookup_min, d.lookup_max = 3, 2, 5
    assert d._guesses([1, 2, 3, 4, 9, 1, 2], need=8) == [3, 4, 9]
    assert d._guesses([1, 2, 3, 4, 9, 1, 2], need=3) == [3, 4]  # the first draft is the model's own
    assert d._guesses([1, 2, 3, 4, 9, 1, 2], need=1) == [] and d._guesses([5, 6, 7], need=8) == []
    spec = parse_speculative_config('{"method": "draft_model", "model": "m", "draft_lookup_tokens": 4}')
    assert spec.draft_lookup_tokens == 4
    for bad, says in (('{"method": "ngram", "draft_lookup_tokens": 2}', "applies to method \"draft_model\""),
                      ('{"method": "draft_model", "model": "m", "draft_lookup_tokens": 17}', r"in \[0, 16\]"),
                      ('{"method": "draft_model", "model": "m", "draft_lookup_tokens": "3"}', "int")):
        with pytest.raises(SpecserveError, match=says):
            parse_speculative_config(bad)
