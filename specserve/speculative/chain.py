"""Chained drafters (``{"method": "chain", "drafters": [...]}``, as llama.cpp's
``--spec-type draft-mtp,ngram-mod``): per sequence and step, the first drafter with a proposal.

Each step the drafters are asked in order; a sequence leaves the chain at the first drafter
that proposes at least one token. A drafter's own confidence rule decides whether it proposes
(suffix's ``suffix_decoding_min_token_prob``, ``draft_p_min``, an n-gram match at all), so a
cheap model-free drafter first and a draft model after it means the model runs only for the
sequences and steps the cheap one has nothing for.

Every drafter stays in step with the target whether or not it proposed: ``observe`` (hidden
states, for dflash and MTP), ``on_verified`` and ``on_finished`` go to all of them. The
drafters that keep a cache of their own catch up lazily on the tokens verified since they last
drafted (a draft model runs its forward over them, dflash/MTP turn the queued hidden states into
context rows), so a step where a drafter does not propose costs it nothing.

Cost, for the adaptive policy: a drafter's ``draft_cost`` weighted by how often it actually runs
(a running share of the steps on which some sequence fell through to it).
"""

from __future__ import annotations

import torch

from specserve.engine.sequence import Sequence
from specserve.speculative.drafter import Drafter, Proposal

RATE_ALPHA = 0.1  # running share of drafting steps on which a drafter ran


class ChainDrafter(Drafter):
    name = "chain"

    def __init__(self, drafters: list[Drafter], caps: list[int]):
        if not drafters or len(drafters) != len(caps):
            raise ValueError("a chain needs one draft-length cap per drafter")
        names = [d.name for d in drafters]
        if len(set(names)) != len(names):  # their per-sequence states share one dict
            raise ValueError(f"a chain's drafters must differ, got {names}")
        self.drafters, self.caps = list(drafters), list(caps)
        self.hidden_layers = tuple(sorted({i for d in drafters for i in d.hidden_layers}))
        self.has_cost = any(d.has_cost for d in drafters)
        self.rates = [1.0] * len(drafters)  # until measured, as if every drafter ran every step
        self.wins = [0] * len(drafters)  # proposals each drafter supplied (for reports)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        out = [Proposal([]) for _ in seqs]
        todo = [i for i, k in enumerate(num_tokens) if k > 0]
        if not todo:
            return out
        for j, (drafter, cap) in enumerate(zip(self.drafters, self.caps)):
            self.rates[j] += RATE_ALPHA * (bool(todo) - self.rates[j])
            if not todo:
                continue
            props = drafter.propose([seqs[i] for i in todo], [min(num_tokens[i], cap) for i in todo])
            left = []
            for i, prop in zip(todo, props):
                if prop.token_ids:
                    out[i] = prop
                    self.wins[j] += 1
                else:  # nothing here: the next drafter tries; a cut (work spent, nothing sure) is kept
                    out[i] = Proposal([], cut=out[i].cut or prop.cut)
                    left.append(i)
            todo = left
        return out

    def observe(self, seq: Sequence, hidden: dict[int, torch.Tensor], positions: list[int]) -> None:
        for d in self.drafters:
            if d.hidden_layers:
                d.observe(seq, {i: hidden[i] for i in d.hidden_layers}, positions)

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        for d in self.drafters:  # one that did not propose this step has no drafts to roll back
            d.on_verified(seq, num_accepted)

    def on_finished(self, seq: Sequence) -> None:
        for d in self.drafters:
            d.on_finished(seq)

    def weight_bytes(self) -> int:
        return sum(d.weight_bytes() for d in self.drafters)

    def kv_bytes(self) -> int:
        return sum(d.kv_bytes() for d in self.drafters)

    def warm_up(self, make_seq) -> None:
        for d in self.drafters:
            d.warm_up(make_seq)

    def draft_cost(self, k: int) -> float:
        if k <= 0:
            return 0.0
        return sum(r * d.draft_cost(min(k, cap)) for d, cap, r in zip(self.drafters, self.caps, self.rates))

    def catch_up_cost(self, n: int) -> float:
        return sum(r * d.catch_up_cost(n) for d, r in zip(self.drafters, self.rates))
