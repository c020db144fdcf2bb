"""The synchronous engine: admit requests, run one batched forward per step, verify drafts.

A step mixes, in one forward pass, the decode rows of running sequences (each its last
token plus its draft tokens) and prefill chunks of new prompts (chunked prefill, within
``max_num_batched_tokens``). Because every kernel is batch-invariant, a sequence's tokens
do not depend on what else shares the batch, on chunking, or on speculation.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from specserve.engine import sampler
from specserve.engine.block_manager import BlockManager, BlockTable, NoFreeBlocks
from specserve.engine.config import EngineConfig, MemoryPlan, engine_plan
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.sequence import Sequence, Status
from specserve.engine.step_budget import batch_keys, prefill_budget
from specserve.engine.types import EngineStats, RequestOutput, SamplingParams, SpecStats
from specserve.errors import RequestError
from specserve.models.loader import LoadedModel
from specserve.models.transformer import ForwardBatch, KVCache
from specserve.spec.adaptive import CostModel, DraftPolicy, calibrate
from specserve.spec.config import SpecConfig
from specserve.spec.drafter import Drafter, Proposal
from specserve.spec.verify import verify_greedy, verify_sampling

log = logging.getLogger("specserve.engine")

CALIBRATE_MAX_K = 15  # start-up timing covers draft lengths up to this (wider ones are extrapolated)


@dataclass
class _Row:
    """The rows one sequence contributes to a forward pass."""

    seq: Sequence
    start: int  # first row in the batch
    count: int
    drafts: list[int]
    draft_probs: torch.Tensor | None
    sample: bool  # logits wanted (decode, or the chunk that ends the prompt)
    cut: bool = False  # the drafter stopped short of the draft length asked for (draft_p_min)


class LLMEngine:
    def __init__(self, target: LoadedModel, ecfg: EngineConfig, spec: SpecConfig | None = None,
                 drafter: Drafter | None = None):
        self.target, self.ecfg, self.spec, self.drafter = target, ecfg, spec, drafter
        self.model, self.tokenizer = target.model, target.tokenizer
        self.device = self.model.device
        mcfg = target.config
        self.max_model_len = ecfg.context_len(mcfg.max_position)
        self.plan: MemoryPlan = plan_for(target, ecfg, spec, drafter)
        plan = self.plan
        self.kv = KVCache.allocate(mcfg, plan.num_blocks, ecfg.block_size, plan.kv_dtype, self.device,
                                   window_blocks=plan.window_blocks or None)
        # sliding-window layers: a fixed pool of their own; blocks that slide out of the window go back
        self.window = plan.sliding_window
        self.wblocks = BlockManager(plan.window_blocks, ecfg.block_size, False) if self.window else None
        prefix_caching = ecfg.enable_prefix_caching and not self.window
        if ecfg.enable_prefix_caching and self.window:
            log.warning("prefix caching is off for %s: its sliding-window layers keep only the last %d tokens",
                        target.name, self.window)
        self.blocks = BlockManager(plan.num_blocks, ecfg.block_size, prefix_caching, salt=target.identity)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.totals = SpecStats()
        self.num_preemptions = 0
        self.cost = CostModel()
        k_max = spec.num_speculative_tokens if spec else 0
        self.policy = DraftPolicy(k_max, bool(spec and spec.adaptive), self.cost,
                                  drafter.draft_cost if drafter else lambda k: 0.0)
        self._max_blocks = -(-self.max_model_len // ecfg.block_size) + 1
        if self.policy.adaptive and drafter is not None:
            self._calibrate(k_max)

    def _calibrate(self, k_max: int) -> None:
        """Measure the verification widths 1 .. k_max + 1 (and the drafter's own step) once, so
        that the first steps already choose draft lengths from this machine's costs."""
        widths = list(range(1, min(k_max, CALIBRATE_MAX_K) + 2))
        eos = self.tokenizer.eos_token_ids
        filler = min(eos) if eos else 0

        def scratch() -> Sequence:
            params = SamplingParams(max_tokens=max(widths) + 1, ignore_eos=True)
            return Sequence("calibrate", [filler] * max(widths), params,
                            IncrementalDetokenizer(self.tokenizer, [], params.stop))

        def run(width: int) -> None:  # one sequence verifying width - 1 drafts: logits for every row
            seq = scratch()
            if self._reserve(seq, width):
                row = _Row(seq, 0, width, [filler] * (width - 1), None, True)
                self.model.forward(self._build_batch([row]), self.kv)
            self._free(seq)

        calibrate(self.cost, run, widths)
        self.drafter.warm_up(scratch)

    # ---- requests --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request this engine can never serve."""
        if not prompt_ids:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError("the prompt has token ids outside the vocabulary", param="prompt")
        named = (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids))
        for name, ids in named:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})", param=name)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens is {params.max_tokens}", param="max_tokens",
                code="context_length_exceeded")
        lookahead = self.spec.num_speculative_tokens + 1 if self.spec else 1
        if self.blocks.blocks_needed(len(prompt_ids) + params.max_tokens + lookahead) > self.blocks.num_blocks:
            raise RequestError(f"prompt plus max_tokens ({len(prompt_ids) + params.max_tokens} tokens) is more than "
                               f"the KV pool holds ({self.plan.pool_tokens} tokens)", param="max_tokens",
                               code="context_length_exceeded")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.validate(prompt_ids, params)
        if request_id in self.by_id:
            raise RequestError(f"duplicate request id {request_id!r}")
        params = replace(params, eos_token_ids=tuple(sorted(self.tokenizer.eos_token_ids)))  # end_token_ids
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.min_tokens,
                                       params.include_stop_str_in_output, params.skip_special_tokens)
        seq = Sequence(request_id, list(prompt_ids), params, detok)
        if not params.greedy:
            seq.generator = sampler.make_generator(params.seed, hash((self.ecfg.seed, request_id)) & 0xFFFFFFFF)
        self.waiting.append(seq)
        self.by_id[request_id] = seq

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.by_id.get(request_id)
        if seq is None or seq.finished:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        return self._finish(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), len(self.waiting), self.blocks.num_blocks, self.blocks.num_free,
                           self.num_preemptions)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._admit()
        if not self.running:
            return []
        rows = self._schedule()
        if not rows:
            return []
        batch = self._build_batch(rows)
        t0 = time.perf_counter()
        out = self.model.forward(batch, self.kv)
        self.cost.add(int(batch.input_ids.shape[0]), time.perf_counter() - t0, keys=batch_keys(batch.positions))
        return self._process(rows, out.logits, out.hidden)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.ecfg.max_num_seqs:
            seq = self.waiting[0]
            if not seq.table.blocks:
                seq.num_cached = seq.num_computed = self.blocks.match_prefix(seq.table, seq.token_ids)
            remaining = seq.num_tokens + 1 - len(seq.table.blocks) * self.ecfg.block_size
            if not self.blocks.can_allocate(self.blocks.blocks_needed(max(remaining, 0)) + 1) and self.running:
                # wait until running sequences free memory, without pinning the cached blocks it
                # matched: a running sequence may need them (it would preempt itself forever)
                self._free(seq)
                seq.num_cached = seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _prefill_end(self, seq: Sequence) -> int:
        return len(seq.prompt_ids) if not seq.output_ids else seq.num_tokens - 1

    def _schedule(self) -> list[_Row]:
        budget = self.ecfg.max_num_batched_tokens
        decode = [s for s in self.running if s.num_computed >= self._prefill_end(s)]
        proposals = self._propose(decode)
        rows: list[_Row] = []
        for seq, prop in zip(decode, proposals):
            if seq.finished or seq.status is not Status.RUNNING:
                continue
            if not self._reserve(seq, seq.num_computed + 1 + len(prop.token_ids)):
                continue
            rows.append(_Row(seq, 0, 1 + len(prop.token_ids), prop.token_ids, prop.probs, True, prop.cut))
            budget -= rows[-1].count
        prefill = [s for s in self.running if s.num_computed < self._prefill_end(s)]
        budget = prefill_budget(self.cost.passes, self.ecfg.max_step_ms, [(r.count, r.seq.num_computed) for r in rows],
                                [s.num_computed for s in prefill], budget)  # --max-step-ms: engine/step_budget.py
        for seq in prefill:
            chunk = min(max(budget, 0), self._prefill_end(seq) - seq.num_computed)
            if chunk <= 0 or not self._reserve(seq, seq.num_computed + chunk + 1):
                break
            done = seq.num_computed + chunk == self._prefill_end(seq)
            rows.append(_Row(seq, 0, chunk, [], None, done and not seq.output_ids))
            budget -= chunk
        rows = [r for r in rows if r.seq.status is Status.RUNNING]
        start = 0
        for r in rows:
            r.start, start = start, start + r.count
        return rows

    def _propose(self, seqs: list[Sequence]) -> list[Proposal]:
        if not self.drafter or not seqs:
            return [Proposal([]) for _ in seqs]
        limits = [min(s.params.max_tokens - len(s.output_ids) - 1, self.max_model_len - s.num_tokens - 1)
                  for s in seqs]
        ks = self.policy.lengths(seqs, limits)
        return [Proposal(p.token_ids[:k], None if p.probs is None else p.probs[:k], p.cut)
                for p, k in zip(self.drafter.propose(seqs, ks), ks)]

    def _tables(self, seq: Sequence) -> list[tuple[BlockManager, BlockTable]]:
        """The sequence's block tables, each with its pool (sliding-window layers have their own)."""
        if self.wblocks is None:
            return [(self.blocks, seq.table)]
        return [(self.blocks, seq.table), (self.wblocks, seq.wtable)]

    def _free(self, seq: Sequence) -> None:
        for blocks, table in self._tables(seq):
            blocks.free(table)

    def _slide(self, seq: Sequence) -> None:
        """Release sliding-window blocks no later query can see (keys before pos - window + 1)."""
        if self.wblocks is not None:
            self.wblocks.release_before(seq.wtable, seq.num_computed - self.window + 1)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for num_tokens in seq's blocks, preempting the newest other sequences."""
        while True:
            try:
                for blocks, table in self._tables(seq):
                    blocks.ensure_capacity(table, num_tokens)
                return True
            except NoFreeBlocks:
                victim = next((s for s in reversed(self.running) if s is not seq), None)
                if victim is None:
                    self._preempt(seq)
                    return False
                self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's KV and put it back at the head of the queue; it resumes later."""
        log.info("preempting %s (KV pool full)", seq.request_id)
        self.num_preemptions += 1
        if self.drafter:  # before the KV is freed: the drafter may keep state of the cached blocks
            self.drafter.on_finished(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _build_batch(self, rows: list[_Row]) -> ForwardBatch:
        ids, pos, sids, logit_rows = [], [], [], []
        # one (slots, block tables) pair per pool: the global one, then the sliding-window one if any
        groups = [([], torch.zeros((len(rows), self._max_blocks), dtype=torch.int32))
                  for _ in range(1 + (self.wblocks is not None))]
        bs = self.ecfg.block_size
        for i, r in enumerate(rows):
            seq = r.seq
            toks = (seq.token_ids[seq.num_computed:seq.num_computed + r.count] if not r.drafts
                    else [seq.token_ids[seq.num_computed]] + r.drafts)
            p = list(range(seq.num_computed, seq.num_computed + r.count))
            ids += toks
            pos += p
            sids += [i] * r.count
            for (slots, tables), (_, table) in zip(groups, self._tables(seq)):
                blocks = table.blocks  # released blocks stay HOLE (-1): the kernel refuses to read them
                slots += [blocks[x // bs] * bs + x % bs for x in p]
                tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            if r.sample:
                logit_rows += range(r.start + (r.count - 1 if not r.drafts and r.count > 1 else 0),
                                    r.start + r.count)
        dev = self.device
        paging = [(tables.to(dev), torch.tensor(slots, dtype=torch.int64, device=dev)) for slots, tables in groups]
        window = paging[1] if len(paging) > 1 else (None, None)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int32, device=dev),
            seq_ids=torch.tensor(sids, dtype=torch.int32, device=dev),
            block_tables=paging[0][0],
            slot_mapping=paging[0][1],
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            hidden_layers=self.drafter.hidden_layers if self.drafter else (),
            window_block_tables=window[0],
            window_slot_mapping=window[1],
        )

    def _observe(self, r: _Row, start: int, count: int, hidden: dict[int, torch.Tensor]) -> None:
        """Hand the drafter the target's hidden states of the rows whose K/V were kept."""
        if self.drafter and self.drafter.hidden_layers and count:
            rows = slice(r.start, r.start + count)
            self.drafter.observe(r.seq, {k: v[rows] for k, v in hidden.items()}, list(range(start, start + count)))

    # ---- after the forward -----------------------------------------------------------------
    def _process(self, rows: list[_Row], logits: torch.Tensor,
                 hidden: dict[int, torch.Tensor]) -> list[RequestOutput]:
        outputs, cursor = [], 0
        for r in rows:
            seq = r.seq
            n_logits = (1 + len(r.drafts)) if r.sample else 0
            lg = logits[cursor:cursor + n_logits]
            cursor += n_logits
            if not r.drafts and not r.sample:  # a prefill chunk that does not end the prompt
                self._observe(r, seq.num_computed, r.count, hidden)
                seq.num_computed += r.count
                self.blocks.commit(seq.table, seq.token_ids, seq.num_computed)
                self._slide(seq)
                continue
            computed_before = seq.num_computed if r.drafts or r.count == 1 else seq.num_computed + r.count - 1
            n_acc, new = self._verify(seq, lg, r.drafts, r.draft_probs)
            if r.drafts:
                seq.spec.record(len(r.drafts), n_acc)
                self.totals.record(len(r.drafts), n_acc)
            DraftPolicy.update(seq, len(r.drafts), n_acc, r.cut)  # no news without drafts or a cut
            first = seq.num_computed
            seq.num_computed = computed_before + 1 + n_acc
            self._observe(r, first, seq.num_computed - first, hidden)
            for blocks, table in self._tables(seq):
                blocks.truncate(table, seq.num_computed + 1)
            self._slide(seq)
            if self.drafter:
                self.drafter.on_verified(seq, n_acc)
            out = self._append(seq, new, lg)
            if out is not None:
                outputs.append(out)
        return outputs

    def _verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int],
                draft_probs: torch.Tensor | None) -> tuple[int, list[int]]:
        p = seq.params
        lg = sampler.penalize(logits, p, seq.prompt_ids, seq.output_ids, drafts)
        if p.greedy:
            return verify_greedy(lg, drafts)
        probs = sampler.probs_from_logits(lg, p)
        return verify_sampling(probs, drafts, draft_probs, seq.generator)

    def _append(self, seq: Sequence, new: list[int], logits: torch.Tensor) -> RequestOutput | None:
        """Add verified tokens one by one, stopping at EOS, stop ids, stop strings or max_tokens."""
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        p, reason, kept = seq.params, None, []
        for tok in new:
            seq.output_ids.append(tok)
            kept.append(tok)
            stop_tok = tok in p.end_token_ids
            # a stop token ends the request without its text (unless include_stop_str_in_output), as in vLLM
            hit_stop = seq.detok.add(tok) if not stop_tok or p.include_stop_str_in_output else False
            if stop_tok or hit_stop:
                reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                break
        if p.logprobs is not None:
            seq.pending_logprobs += sampler.top_logprobs(logits[:len(kept)], kept, p.logprobs)
        seq.pending_ids += kept
        self.blocks.commit(seq.table, seq.token_ids, seq.num_computed)
        if reason:
            return self._finish(seq, reason)
        return self._delta(seq)

    def _delta(self, seq: Sequence, final: bool = False) -> RequestOutput | None:
        text = seq.detok.delta(final=final)
        if not (seq.pending_ids or text or final):
            return None
        out = RequestOutput(
            seq.request_id, seq.pending_ids, text, seq.pending_logprobs if seq.params.logprobs is not None else None,
            seq.finished, seq.finish_reason, len(seq.prompt_ids), len(seq.output_ids), seq.num_cached,
            seq.spec if self.spec else None,
            None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            seq.prefill_time(), seq.decode_time())
        seq.pending_ids, seq.pending_logprobs = [], []
        return out

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        seq.status, seq.finish_reason, seq.finished_at = Status.FINISHED, reason, time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        if self.drafter:  # before the KV is freed: the drafter may keep state of the cached blocks
            self.drafter.on_finished(seq)
        self._free(seq)
        self.by_id.pop(seq.request_id, None)
        return self._delta(seq, final=True)

    # ---- convenience -----------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "req-0"):
        """Run one request to completion, yielding its deltas (for the CLI and tests)."""
        self.add_request(request_id, prompt_ids, params)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return


def plan_for(target: LoadedModel, ecfg: EngineConfig, spec: SpecConfig | None, drafter: Drafter | None,
             total_memory: int | None = None) -> MemoryPlan:
    """The memory plan of an engine over target with this drafter (``specserve plan`` prints it)."""
    model = target.model
    return engine_plan(ecfg, target.config, model.dtype, model.device, model.weight_bytes(),
                       drafter.weight_bytes() if drafter else 0, total_memory,
                       lookahead=(spec.num_speculative_tokens if spec else 0) + 1,
                       drafter_kv_bytes=drafter.kv_bytes() if drafter else 0)
