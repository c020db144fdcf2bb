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

A drafter that proposes but is seldom right for a sequence yields to the next one: the chain
keeps, per sequence, a running share of each drafter's drafts that verification accepted, and
a drafter (not the last) whose share falls under ``MIN_ACCEPT`` is skipped for that sequence,
except on every ``PROBE_EVERY``-th step, when it is asked again so that it can earn its turn
back (suffix decoding proposing on prose, where the draft model behind it guesses better).

Cost, for the adaptive policy: a drafter's ``draft_cost`` weighted by how often it actually runs
(a running share of the steps on which some sequence fell through to it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sequence import Sequence
from specserve.speculative.drafter import Drafter, Proposal

RATE_ALPHA = 0.1  # running share of drafting steps on which a drafter ran
ACCEPT_ALPHA = 0.3  # running share of a drafter's drafts accepted, per sequence
MIN_ACCEPT = 0.25  # below it a drafter (not the last) yields to the next for the sequence
PROBE_EVERY = 8  # ... except on every this-many-th step of the sequence


@dataclass
class _SeqChain:
    """A sequence's record in the chain: each drafter's accepted share, who proposed last."""

    accept: list[float]  # per drafter, starting optimistic (1.0)
    last: int = -1  # the drafter whose proposal is being verified (-1: none)
    proposed: int = 0  # its number of drafts
    steps: int = 0  # proposals made for the sequence

    def yields(self, j: int) -> bool:
        return self.accept[j] < MIN_ACCEPT and self.steps % PROBE_EVERY != 0


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
        states = {i: self._state(seqs[i]) for i in todo}
        last = len(self.drafters) - 1
        for j, (drafter, cap) in enumerate(zip(self.drafters, self.caps)):
            skip = {i for i in todo if j < last and states[i].yields(j)}  # seldom right here: the next one
            ask = [i for i in todo if i not in skip]
            self.rates[j] += RATE_ALPHA * (bool(ask) - self.rates[j])
            props = drafter.propose([seqs[i] for i in ask], [min(num_tokens[i], cap) for i in ask]) if ask else []
            left = list(skip)
            for i, prop in zip(ask, props):
                if prop.token_ids:
                    out[i] = prop
                    self.wins[j] += 1
                    states[i].last, states[i].proposed = j, len(prop.token_ids)
                else:  # nothing here: the next drafter tries; a cut (work spent, nothing sure) is kept
                    out[i] = Proposal([], cut=out[i].cut or prop.cut)
                    left.append(i)
            todo = sorted(left)
        for st in states.values():
            st.steps += 1
        return out

    def _state(self, seq: Sequence) -> _SeqChain:
        st = seq.drafter_state.get(self.name)
        if st is None:
            st = seq.drafter_state[self.name] = _SeqChain([1.0] * len(self.drafters))
        return st

    def observe(self, seq: Sequence, hidden: dict[int, torch.Tensor], positions: list[int]) -> None:
        for d in self.drafters:
            if d.hidden_layers:
                d.observe(seq, {i: hidden[i] for i in d.hidden_layers}, positions)

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        st = seq.drafter_state.get(self.name)
        if st is not None and st.last >= 0:
            share = min(num_accepted, st.proposed) / st.proposed
            st.accept[st.last] += ACCEPT_ALPHA * (share - st.accept[st.last])
            st.last = -1
        for d in self.drafters:  # one that did not propose this step has no drafts to roll back
            d.on_verified(seq, num_accepted)

    def on_finished(self, seq: Sequence) -> None:
        seq.drafter_state.pop(self.name, None)
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

    def unread(self, seq: Sequence) -> int:
        # the least of its drafters': one that reads as it goes (suffix, n-gram) drafts with no catch-up,
        # so a long prompt does not stop the whole chain (a draft model in it catches up when first asked)
        return min(d.unread(seq) for d in self.drafters)
