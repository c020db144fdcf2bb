"""The scheduler: which sequences run in the next step, how many rows each, and how many
drafts each decode row may verify.

A step mixes the decode rows of running sequences (the last token plus up to k drafts) with
prefill chunks of prompts (chunked prefill, within ``max_num_batched_tokens``). Draft lengths
are chosen once the step's width is known: the adaptive policy sees the prefill tokens that share
the forward pass. Cache room for every row, drafts included, is reserved here (lookahead), so
verification never finds it has nowhere to write; when the pool is full the newest other
sequences are preempted (freed and requeued at the front)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.engine.cache import CacheCoordinator
from specserve.engine.block_manager import NoFreeBlocks
from specserve.engine.config import EngineConfig
from specserve.engine.sequence import Sequence, Status
from specserve.engine.step_budget import prefill_budget
from specserve.speculative.adaptive import DraftPolicy

log = logging.getLogger("specserve.engine")

PROMPT_LOGPROBS_CHUNK = 256  # prompt rows per step of a request asking for prompt logprobs


@dataclass
class ScheduledRow:
    """The rows one sequence contributes to a forward pass."""

    seq: Sequence
    start: int  # first row in the batch
    count: int  # rows: the prefill chunk, or 1 + the draft tokens
    sample: bool  # logits wanted (decode, or the chunk that ends the prompt)
    num_drafts: int = 0  # draft tokens asked of the drafter (decode rows)
    drafts: list[int] | None = None  # the drafter's proposal, filled in before the forward
    draft_probs: torch.Tensor | None = None  # [len(drafts), vocab] or None (point masses)
    cut: bool = False  # the drafter stopped short of the draft length asked for (draft_p_min)

    @property
    def decode(self) -> bool:
        return self.drafts is not None


class Scheduler:
    def __init__(self, ecfg: EngineConfig, cache: CacheCoordinator, policy: DraftPolicy, max_model_len: int,
                 on_preempt: Callable[[Sequence], None] = lambda seq: None,
                 computable: Callable[[Sequence], int] | None = None):
        self.ecfg, self.cache, self.policy = ecfg, cache, policy
        self.max_model_len = max_model_len
        self.on_preempt = on_preempt  # before a preempted sequence's cache is freed (drafter state)
        # how far a sequence's prompt can be computed now (its first image not encoded yet stops it)
        self.computable = computable or (lambda seq: seq.num_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def admit(self) -> None:
        deferred: list[Sequence] = []  # waiting for a running prefill of their prefix, in queue order
        while self.waiting and len(self.running) < self.ecfg.max_num_seqs:
            seq = self.waiting[0]
            if not self.cache.has_tables(seq) and not seq.needs_prompt_logprobs:
                if self._prefix_in_flight(seq):
                    deferred.append(self.waiting.popleft())
                    continue
                seq.num_cached = seq.num_computed = self.cache.match_prefix(seq)
            if not self.cache.can_admit(seq, seq.num_tokens + 1) and self.running:
                # wait until running sequences free memory, without pinning the cached blocks it
                # matched: a running sequence may need them (it would preempt itself forever)
                self.cache.free(seq)
                seq.num_cached = seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.started_at is None:  # its prefill starts now: the time queued is not prefill time
                seq.started_at = time.perf_counter()
            self.running.append(seq)
        self.waiting.extendleft(reversed(deferred))

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether a running prompt's prefill has yet to compute blocks of seq's prefix. seq then
        waits until they are committed and computes only the rest: the n choices of one prompt,
        or requests arriving together with one system prompt, compute their common prefix once
        (as vLLM's prefix cache does). Blocks it computed already are in the cache (committed
        chunk by chunk), so it is not asked to match them."""
        prefilling = [r for r in self.running if r.num_computed < self.prefill_end(r)]
        if not prefilling or not self.cache.prefix_caching:
            return False
        bs, keys = self.cache.main.spec.block_size, seq.cache_keys
        reach = (len(keys) - 1) // bs * bs  # the most match_prefix attaches (the last token is computed)
        for r in prefilling:
            end = min(self.prefill_end(r), reach)
            if r.num_computed < end and shared_blocks(keys, r.cache_keys, end, bs) * bs > r.num_computed:
                return True
        return False

    @staticmethod
    def prefill_end(seq: Sequence) -> int:
        """Tokens to compute before seq decodes (all but the last, which the decode row feeds)."""
        return len(seq.prompt_ids) if not seq.output_ids else seq.num_tokens - 1

    # ---- the step --------------------------------------------------------------------------
    def schedule(self, drafting: bool, spent_ms: float = 0.0) -> list[ScheduledRow]:
        """spent_ms: what the step already spent of --max-step-ms (encoding images ahead)."""
        budget = self.ecfg.max_num_batched_tokens
        decode = [s for s in self.running if s.num_computed >= self.prefill_end(s)]
        prefill = [s for s in self.running if s.num_computed < self.prefill_end(s)]
        prefill_width = min(max(budget - len(decode), 0),
                            sum(self.prefill_end(s) - s.num_computed for s in prefill))
        ks = self._draft_lengths(decode, prefill_width) if drafting else [0] * len(decode)
        rows: list[ScheduledRow] = []
        for seq, k in zip(decode, ks):
            if seq.status is not Status.RUNNING or not self._reserve(seq, seq.num_computed + 1 + k):
                continue
            rows.append(ScheduledRow(seq, 0, 1 + k, True, num_drafts=k, drafts=[]))
            budget -= rows[-1].count
        step_ms = self.ecfg.max_step_ms
        if step_ms > 0 and spent_ms > 0:  # (a budget spent already still gives the minimum chunk)
            step_ms = max(step_ms - spent_ms, 1e-9)
        budget = prefill_budget(self.policy.cost.passes, step_ms,  # --max-step-ms
                                [(r.count, r.seq.num_computed) for r in rows], [s.num_computed for s in prefill],
                                budget)
        for seq in prefill:
            chunk = min(max(budget, 0), self.prefill_end(seq) - seq.num_computed)
            if seq.needs_prompt_logprobs:  # a logits row per token: bound the step's [rows, vocab] logits
                chunk = min(chunk, PROMPT_LOGPROBS_CHUNK)
            if chunk > 0 and seq.mm is not None:  # stop before an image still being encoded
                chunk = min(chunk, self.computable(seq) - seq.num_computed)
                if chunk <= 0:
                    continue
            if chunk <= 0 or not self._reserve(seq, seq.num_computed + chunk + 1):
                break
            done = seq.num_computed + chunk == self.prefill_end(seq)
            rows.append(ScheduledRow(seq, 0, chunk, done and not seq.output_ids and seq.params.max_tokens > 0))
            budget -= chunk
        return [r for r in rows if r.seq.status is Status.RUNNING]

    def _draft_lengths(self, seqs: list[Sequence], prefill_width: int) -> list[int]:
        limits = [min(s.params.max_tokens - len(s.output_ids) - 1, self.max_model_len - s.num_tokens - 1)
                  for s in seqs]
        return self.policy.lengths(seqs, limits, extra_width=prefill_width) if seqs else []

    @staticmethod
    def place(rows: list[ScheduledRow]) -> None:
        """Give each row its offset in the batch, once the drafts (and so the widths) are known."""
        start = 0
        for r in rows:
            if r.decode:
                r.count = 1 + len(r.drafts)
            r.start, start = start, start + r.count

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for num_tokens in seq's cache, preempting the newest other sequences."""
        while True:
            try:
                self.cache.reserve(seq, num_tokens)
                return True
            except NoFreeBlocks:
                victim = next((s for s in reversed(self.running) if s is not seq), None)
                if victim is None:
                    self.preempt(seq)
                    return False
                self.preempt(victim)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return self._reserve(seq, num_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's cache and put it back at the head of the queue; it resumes later."""
        log.info("preempting %s (KV pool full)", seq.request_id)
        self.num_preemptions += 1
        self.on_preempt(seq)  # before the cache is freed: the drafter may keep state of the cached blocks
        self.cache.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)


def shared_blocks(a: list[int], b: list[int], limit: int, bs: int) -> int:
    """How many whole blocks of bs tokens the lists a and b share from the start, within a[:limit]."""
    n = 0
    while (n + 1) * bs <= limit and a[n * bs:(n + 1) * bs] == b[n * bs:(n + 1) * bs]:
        n += 1
    return n
