"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.engine.cache.coordinator import SequenceCache
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.types import SamplingParams, AcceptanceStats, TokenLogprob

if TYPE_CHECKING:
    from specserve.engine.constraint import Constraint
    from specserve.engine.sampler import PositionNoise
    from specserve.engine.multimodal import MultiModalPrompt


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens served by the prefix cache
    cache: SequenceCache = field(default_factory=SequenceCache)  # a table per cache group (engine.cache)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (RequestOutput)
    generator: torch.Generator | None = None
    sample_key: int = 0  # what its randomness comes from: its seed, or the engine seed's key for its arrival
    noise: "PositionNoise | None" = None  # a seeded sampling request's noise per output position (sampler.py)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    drafter_state: dict = field(default_factory=dict)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    started_at: float | None = None  # first admitted to run (before it: queued)
    finished_at: float | None = None
    accept_ema: float | None = None  # running estimate of the per-token draft acceptance (None: the
    # policy's prior, set at the sequence's first draft-length choice)
    accept_slow: float | None = None  # the same over many steps: where a sequence drafting nothing drifts back to
    constraint: "Constraint | None" = None  # grammar state under structured outputs (engine/constraint.py)
    mm: "MultiModalPrompt | None" = None  # the prompt's images (engine/multimodal.py)
    # prompt_logprobs: the logprob of each prompt token computed so far (None for the first); None = not
    # asked for, or already in an output
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_keys(self) -> list[int]:
        """What the prefix cache hashes: the token ids, each image's placeholders replaced by
        its content key."""
        if self.mm is None:
            return self.token_ids
        return self.mm.cache_keys(self.prompt_ids) + self.output_ids

    @property
    def block_hashes(self) -> list[int]:
        """Prefix-cache hashes of the sequence's full, computed blocks in the growing pool."""
        return self.cache.tables[0].hashes if self.cache.tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        """True while the prompt is not fully in the cache (the last prompt token still to run)."""
        return self.num_computed < len(self.prompt_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked for and some are still to compute: the prompt's blocks
        are then computed here, not matched in the prefix cache (a cached block has no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def prompt_logprob_positions(self, count: int) -> range:
        """Positions among the ``count`` rows from ``num_computed`` (a prefill chunk) whose logits
        give a prompt token's logprob not recorded yet: the row at position p scores token p + 1."""
        if self.prompt_logprobs is None:
            return range(0)
        lo = max(self.num_computed, len(self.prompt_logprobs) - 1)
        hi = min(self.num_computed + count, len(self.prompt_ids) - 1)
        return range(lo, max(lo, hi))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def prefill_time(self) -> float:
        """From admission to the first token (llama-server's prompt_ms: the queue not counted; the
        time to first token, from arrival, is first_token_latency)."""
        return (self.first_token_at or time.perf_counter()) - (self.started_at or self.arrival)

    def decode_time(self) -> float:
        if self.first_token_at is None:
            return 0.0
        return (self.finished_at or time.perf_counter()) - self.first_token_at
