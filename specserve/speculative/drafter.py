"""The drafter interface: every speculation method implements it, in its own module.

A drafter proposes up to k tokens per running sequence, is told which were accepted, and
owns (and rolls back) any state of its own, such as a draft model's KV cache. Drafters that
read the target's hidden states (block drafters, MTP heads) name the layers they need in
``hidden_layers``; the engine then passes those hidden states of every newly computed
token to ``observe``.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.engine import sampler
from specserve.engine.sequence import Sequence
from specserve.kernels.ops import argmax_rows


@dataclass
class Proposal:
    """Draft tokens for one sequence and, optionally, the draft distribution of each."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] or None (point masses)
    cut: bool = False  # stopped short of the length asked for at an unsure draft (draft_p_min)


class Drafter(ABC):
    name: str = "drafter"
    hidden_layers: tuple[int, ...] = ()
    has_cost: bool = False  # True when proposing costs forward passes of a model

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        """Propose up to num_tokens[i] tokens after seqs[i].token_ids."""

    def observe(self, seq: Sequence, hidden: dict[int, torch.Tensor], positions: list[int]) -> None:
        """Target hidden states ([n, H] per layer) of newly computed tokens at ``positions``."""

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        """The target kept ``num_accepted`` of the last proposal; roll back the rest."""

    def on_finished(self, seq: Sequence) -> None:
        """Free any state held for the sequence."""

    def seq_state(self, seq: Sequence, factory):
        """This drafter's per-sequence state, made by ``factory()`` on first use.

        The state gets a ``generator`` of its own when the sequence samples (temperature > 0) without
        a seed (a seeded one drafts with its positions' noise, pick_tokens), seeded apart from every
        other request's: rejection sampling is exact only where the draft is a fresh sample of q, and
        one seed for every unseeded request drew the same drafts for the same prompt each time,
        which biased the output toward them.
        """
        st = seq.drafter_state.get(self.name)
        if st is None:
            st = factory()
            if not seq.params.greedy:
                key = sampler.mix_key(seq.sample_key, zlib.crc32(self.name.encode()))
                st.generator = sampler.make_generator(key)
            seq.drafter_state[self.name] = st
        return st

    @staticmethod
    def module_bytes(module: torch.nn.Module) -> int:
        """Bytes of the weights of a drafter built from the family's modules (for the memory plan):
        its Linears' run-time formats (norm vectors, a few KB, are left out)."""
        from specserve.models.layers import linears

        return sum(lin.nbytes() for lin in linears(module))

    def weight_bytes(self) -> int:
        """Bytes of the drafter's weights (for the memory plan; 0 for model-free drafters)."""
        return 0

    def kv_bytes(self) -> int:
        """Bytes of a fixed KV pool of the drafter's own (a draft model's cache)."""
        return 0

    def warm_up(self, make_seq) -> None:
        """Time the drafter's own step once at start-up (``make_seq(width=None)``: a scratch sequence
        that is dropped afterwards, of ``width`` tokens if given); model-free drafters have nothing to time."""

    def draft_cost(self, k: int) -> float:
        """Seconds to propose k tokens for one sequence (0 for model-free drafters)."""
        return 0.0

    def catch_up_cost(self, n: int) -> float:
        """Seconds a proposal costs on top of ``draft_cost`` when the drafter has not read the
        sequence's last n tokens (0 for drafters that read every token as it comes)."""
        return 0.0

    def unread(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the drafter would read at its next proposal (a draft model's KV
        catching up: the whole prompt at a sequence's first); 0 for drafters that read as they go."""
        return 0


def pick_tokens(seq: Sequence, logits: torch.Tensor, generator: torch.Generator | None,
                earlier: list[int] = (), p_min: float = 0.0) -> Proposal:
    """Draft tokens from draft logits [k, V] (row j = distribution of draft j, after ``earlier``
    drafts), warped exactly like the target's rows: logit_bias and penalties count the
    sequence's tokens plus the earlier drafts. With p_min (llama.cpp's --draft-p-min) the drafts
    stop at the first row whose top probability, in the distribution the draft is picked from
    (softmax of the processed logits when greedy), is under it: a rule on the draft alone, so
    verification stays exact. Under structured outputs each row is masked by the sequence's
    grammar after the earlier drafts, as the target's verification row is (engine/constraint.py).
    A seeded request's drafts are picked with the noise of their positions (sampler.PositionNoise)."""
    p = seq.params
    if p.greedy and not p.modifies_logits and seq.constraint is None:  # every row at once: the argmax per row
        drafts = argmax_rows(logits)
        if p_min:
            sure = (torch.softmax(logits.float(), -1).amax(-1) >= p_min).long().cumprod(0)
            drafts = drafts[:int(sure.sum())]
        return Proposal(drafts, cut=len(drafts) < logits.shape[0])
    output = seq.output_ids + list(earlier)
    drafts: list[int] = []
    probs: list[torch.Tensor] = []
    for j in range(logits.shape[0]):
        allowed = _grammar_row(seq, list(earlier) + drafts, logits.shape[-1])
        # row j alone, penalized as row j of the block: the earlier drafts count as output
        row = sampler.penalize(logits[j:j + 1], p, seq.prompt_ids, output + drafts, (), allowed)
        if allowed is not None and not torch.isfinite(row).any():
            break  # the draft puts no mass on any token the grammar allows: nothing to propose
        if p.greedy:
            if p_min and float(torch.softmax(row[0].float(), -1).max()) < p_min:
                break
            drafts.append(int(row[0].argmax()))
            continue
        q = sampler.probs_from_logits(row, p)[0]
        if p_min and float(q.max()) < p_min:
            break
        if seq.noise is not None:  # a seeded request: the noise the target samples this position with
            drafts.append(sampler.sample_at(q, seq.noise.at(len(output) + len(drafts), q.shape[-1])))
        else:
            drafts.append(sampler.sample_from(q, generator))
        probs.append(q)
    return Proposal(drafts, torch.stack(probs) if probs else None, cut=len(drafts) < logits.shape[0])


def _grammar_row(seq: Sequence, tentative: list[int], width: int) -> torch.Tensor | None:
    """[1, width] tokens the sequence's grammar allows after ``tentative`` drafts, or None."""
    if seq.constraint is None:
        return None
    mask = seq.constraint.mask_after(tentative, width)
    return None if mask is None else mask[None]
