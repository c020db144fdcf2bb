"""Types that cross the boundary between the engine and its users (CLI, server).

The server never touches engine internals: it submits a prompt (token ids) with
:class:`SamplingParams` and reads a stream of :class:`RequestOutput` deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.errors import RequestError

if TYPE_CHECKING:
    from specserve.engine.constraint import ConstraintSpec

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy. top_k == 0 and top_p == 1 and min_p == 0 are "off".
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token; None = off
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob (and the top n) after the
    # tokens before it; None = off. Such a request computes its whole prompt (a cached block has no logits)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), as OpenAI's
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string before this many tokens
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string (or token), not before
    skip_special_tokens: bool = True  # vLLM's: special tokens' text is left out of the output
    eos_token_ids: tuple[int, ...] = ()  # the model's EOS ids, filled in by the engine (see end_token_ids)
    structured: "ConstraintSpec | None" = None  # a grammar the output must match (structured outputs)

    def __post_init__(self) -> None:
        if "" in self.stop:  # an empty stop string would end every request at once
            object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        checks = [
            (self.max_tokens >= 0, "max_tokens", "must be >= 0 (0: the prompt alone, for prompt_logprobs)"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"must be in [0, max_tokens = {self.max_tokens}]"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs", "must be in [0, 20]"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", "must fit in a signed 64-bit integer"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise RequestError(f"{name} {why}, got {getattr(self, name)!r}", param=name)
        for tok, bias in self.logit_bias:
            if not -100 <= bias <= 100:  # also NaN
                raise RequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {tok}",
                                   param="logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def modifies_logits(self) -> bool:
        """Whether logits change before sampling (logit_bias, min_tokens, penalties, a grammar): see
        sampler.penalize."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.structured is not None

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """Token ids that end the request: EOS (unless ignore_eos) and stop_token_ids; banned
        before min_tokens."""
        return (() if self.ignore_eos else self.eos_token_ids) + self.stop_token_ids


@dataclass
class AcceptanceStats:
    """Speculative-decoding counters of one request (or of the whole engine).

    steps: verification forwards; draft_tokens: tokens proposed; accepted_tokens:
    proposed tokens the target kept; accepted_per_pos[i]: how often draft position i
    was accepted. mean_acceptance_length follows llama.cpp: each step also yields one
    token of the target's own, so it is (accepted + steps) / steps.
    """

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "AcceptanceStats") -> None:
        self.steps += other.steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    def line(self) -> str:
        """llama.cpp's one-line summary."""
        return (
            f"draft acceptance = {self.acceptance_rate:.5f} "
            f"({self.accepted_tokens} accepted / {self.draft_tokens} generated), "
            f"mean len = {self.mean_acceptance_length:.2f}"
        )

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens had a higher logprob (prompt logprobs)


@dataclass
class RequestOutput:
    """One delta of a request's stream; the last one has finished=True."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    prompt_tokens: int
    completion_tokens: int  # cumulative
    cached_tokens: int = 0
    acceptance: AcceptanceStats | None = None  # cumulative for the request; None without speculation
    first_token_latency: float | None = None  # seconds from arrival to first token
    prefill_time: float = 0.0
    decode_time: float = 0.0
    # the prompt's logprobs (None for its first token), once, in the first delta after the prompt is computed
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # vLLM's stop_reason, once finished: the stop string or stop token id that ended the request
    # (None: EOS, max_tokens, the context, an abort)
    stop_reason: str | int | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int = 0  # since start: sequences sent back to wait because the KV pool was full

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0
