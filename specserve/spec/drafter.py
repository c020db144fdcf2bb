"""The drafter interface: every speculation method implements it, in its own module.

A drafter proposes up to k tokens per running sequence, is told which were accepted, and
owns (and rolls back) any state of its own, such as a draft model's KV cache. Drafters that
read the target's hidden states (block drafters, MTP heads) name the layers they need in
``hidden_layers``; the engine then passes those hidden states of every newly computed
token to ``observe``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.engine import sampler
from specserve.engine.sequence import Sequence


@dataclass
class Proposal:
    """Draft tokens for one sequence and, optionally, the draft distribution of each."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] or None (point masses)


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

        The state gets a ``generator`` of its own when the sequence samples (temperature > 0), so
        drafts are reproducible for a seeded request whatever else shares the batch.
        """
        st = seq.drafter_state.get(self.name)
        if st is None:
            st = factory()
            if not seq.params.greedy:
                st.generator = sampler.make_generator((seq.params.seed or 0) + 7919, hash(seq.request_id) & 0xFFFF)
            seq.drafter_state[self.name] = st
        return st

    @staticmethod
    def module_bytes(module: torch.nn.Module) -> int:
        """Bytes of a torch drafter's parameters (for the memory plan)."""
        return sum(p.numel() * p.element_size() for p in module.parameters())

    def weight_bytes(self) -> int:
        """Bytes of the drafter's weights (for the memory plan; 0 for model-free drafters)."""
        return 0

    def kv_bytes(self) -> int:
        """Bytes of a fixed KV pool of the drafter's own (a draft model's cache)."""
        return 0

    def warm_up(self, make_seq) -> None:
        """Time the drafter's own step once at start-up (``make_seq()``: a scratch sequence that
        is dropped afterwards); model-free drafters have nothing to time."""

    def draft_cost(self, k: int) -> float:
        """Seconds to propose k tokens for one sequence (0 for model-free drafters)."""
        return 0.0
