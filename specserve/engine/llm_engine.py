"""The synchronous engine: one step is schedule -> propose -> one forward -> verify ->
commit / roll back -> outputs.

The scheduler (:mod:`.scheduler`) picks the step's rows and draft lengths, the drafter proposes,
the model runner (:mod:`.model_runner`) builds the batch and runs it, verification keeps the
accepted drafts, and the cache coordinator (:mod:`.cache`) commits or rolls back each layer
group's state. Because every kernel is batch-invariant, a sequence's tokens do not depend on
what else shares the batch, on chunking, or on speculation.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

import torch

from specserve.engine import sampler
from specserve.engine.block_manager import BlockManager
from specserve.engine.cache import CacheCoordinator, layer_cache_specs
from specserve.engine.constraint import Constraint, cut_proposal
from specserve.engine.config import EngineConfig, MemoryPlan, engine_plan, kv_bytes_per_token, state_checkpoints
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.model_runner import ModelRunner
from specserve.parallel.group import share_hint, share_plan
from specserve.parallel.launch import ranks_sharing_memory
from specserve.engine.multimodal import EncoderCache, ImageInput, MultiModalPrompt, vision_memory
from specserve.engine.scheduler import ScheduledRow, Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.engine.types import AcceptanceStats, EngineStats, RequestOutput, SamplingParams
from specserve.errors import RequestError
from specserve.kernels.library import kernels_available, set_prefetch_t0
from specserve.kernels.tune import HintTrial
from specserve.models.hybrid import RecurrentStates
from specserve.models.loader import LoadedModel
from specserve.models.kv_cache import KVCache
from specserve.speculative.adaptive import CostModel, DraftPolicy, calibrate
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.drafter import Drafter, Proposal
from specserve.speculative.verify import verify_greedy, verify_keyed, verify_sampling

log = logging.getLogger("specserve.engine")

CALIBRATE_MAX_K = 15  # start-up timing covers draft lengths up to this (wider ones are extrapolated)


class LLMEngine:
    def __init__(self, target: LoadedModel, ecfg: EngineConfig, spec: SpeculativeConfig | None = None,
                 drafter: Drafter | None = None):
        self.target, self.ecfg, self.speculative, self.drafter = target, ecfg, spec, drafter
        self.model, self.tokenizer = target.model, target.tokenizer
        self.device = self.model.device
        mcfg = self.model.cfg  # (under tensor parallel: this rank's heads, the KV slice it keeps)
        self.max_model_len = ecfg.context_len(mcfg.max_position)
        self.plan: MemoryPlan = plan_for(target, ecfg, spec, drafter)
        plan = self.plan
        if self.model.tp is not None:
            share_plan(self.model.tp, plan)  # every rank allocates the same blocks of its own heads
        self.kv = KVCache.allocate(mcfg, plan.num_blocks, ecfg.block_size, plan.kv_dtype, self.device,
                                   window_blocks=plan.window_blocks or None)
        k_max = spec.num_speculative_tokens if spec else 0
        specs = layer_cache_specs(mcfg, ecfg.block_size, kv_bytes_per_token(mcfg, plan.kv_dtype, num_layers=1),
                                  window_paged=bool(plan.sliding_window), lookahead=k_max + 1,
                                  checkpoints=state_checkpoints(ecfg))
        if mcfg.hybrid:
            self.kv.states = RecurrentStates.allocate(mcfg, plan.state_slots, plan.state_planes, self.device,
                                                      plan.state_checkpoints)
        if ecfg.enable_prefix_caching and plan.sliding_window:
            log.warning("prefix caching is off for %s: its sliding-window layers keep only the last %d tokens",
                        target.name, plan.sliding_window)
        sizes = [plan.num_blocks] + ([plan.window_blocks] if plan.sliding_window else [])
        sizes += [plan.state_slots] if mcfg.hybrid else []
        self.cache = CacheCoordinator.build(specs, tuple(sizes), ecfg.enable_prefix_caching, salt=target.identity)
        self.totals = AcceptanceStats()
        self.cost = CostModel()
        self.policy = DraftPolicy(k_max, bool(spec and spec.adaptive), self.cost,
                                  drafter.draft_cost if drafter else lambda k: 0.0,
                                  drafter.catch_up_cost if drafter else lambda n: 0.0,
                                  drafter.unread if drafter else lambda seq: 0)
        self.runner = ModelRunner(self.model, self.kv, self.cache, ecfg.block_size,
                                  -(-self.max_model_len // ecfg.block_size) + 1, self.cost,
                                  drafter.hidden_layers if drafter else (), self.encoder_cache(target, ecfg),
                                  self._hint_trial())
        encoder = self.runner.encoder
        self.scheduler = Scheduler(ecfg, self.cache, self.policy, self.max_model_len,
                                   on_preempt=drafter.on_finished if drafter else lambda seq: None,
                                   computable=encoder.computable if encoder is not None else None)
        self.by_id: dict[str, Sequence] = {}
        self._arrivals = itertools.count()  # unseeded sampling requests, numbered for their keys
        if self.policy.adaptive and drafter is not None:
            self._calibrate(k_max)

    @staticmethod
    def encoder_cache(target: LoadedModel, ecfg: EngineConfig) -> EncoderCache | None:
        """Image embeddings by content key (None: the model reads no images)."""
        vision = target.vision
        if vision is None:
            return None
        return EncoderCache(vision, ecfg.encoder_cache_bytes)

    @property
    def blocks(self) -> BlockManager:
        """The growing full-attention pool (what admission, preemption and the metrics count)."""
        return self.cache.main.pool

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def _scratch(self, width: int) -> Sequence:
        """A throw-away sequence of ``width`` filler tokens, for timing forwards of up to that width."""
        eos = self.tokenizer.eos_token_ids
        params = SamplingParams(max_tokens=width + 1, ignore_eos=True)
        return Sequence("calibrate", [min(eos) if eos else 0] * width, params,
                        IncrementalDetokenizer(self.tokenizer, [], params.stop))

    def _time_width(self, width: int) -> None:
        """One forward of a sequence verifying width - 1 drafts (logits for every row), then freed."""
        seq = self._scratch(CALIBRATE_MAX_K + 1)  # (the widest the calibration times)
        if self.scheduler.reserve(seq, width):
            filler = seq.prompt_ids[0]
            self.runner.run([ScheduledRow(seq, 0, width, True, num_drafts=width - 1, drafts=[filler] * (width - 1))],
                            timed=False)
        self.cache.free(seq)

    def _hint_trial(self) -> HintTrial | None:
        """The trial that chooses the weight streams' prefetch hint over the first real forwards
        (kernels/tune.py; the runner runs it), or None: not the CPU kernels, or the hint forced."""
        if torch.device(self.device).type != "cpu" or not kernels_available():
            return None
        tp = self.model.tp  # a tensor-parallel target: every rank runs under the driver's hint
        trial, forced = HintTrial.begin(set_prefetch_t0 if tp is None else share_hint(tp, set_prefetch_t0))
        if forced:
            log.info("weight prefetch: %s (%s)", forced["prefetch"], forced["source"])
        return trial

    def _calibrate(self, k_max: int) -> None:
        """Measure the verification widths 1 .. k_max + 1 (and the drafter's own step) once, so
        that the first steps already choose draft lengths from this machine's costs."""
        widths = list(range(1, min(k_max, CALIBRATE_MAX_K) + 2))
        calibrate(self.cost, self._time_width, widths)
        self.drafter.warm_up(lambda width=None: self._scratch(width or max(widths)))

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
        # a sequence's cache never holds more than its prompt and max_tokens: the scheduler caps each
        # step's drafts by the tokens left (a prompt alone, max_tokens 0, reserves one row past it)
        if self.blocks.blocks_needed(len(prompt_ids) + max(params.max_tokens, 1)) > self.blocks.num_blocks:
            raise RequestError(f"prompt plus max_tokens ({len(prompt_ids) + params.max_tokens} tokens) is more than "
                               f"the KV pool holds ({self.plan.pool_tokens} tokens)", param="max_tokens",
                               code="context_length_exceeded")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    images: list[ImageInput] | None = None) -> None:
        """images: the prompt's images in order, one per run of image placeholder tokens."""
        self.validate(prompt_ids, params)
        mm = self.place_images(prompt_ids, images) if images else None
        if request_id in self.by_id:
            raise RequestError(f"duplicate request id {request_id!r}")
        params = replace(params, eos_token_ids=tuple(sorted(self.tokenizer.eos_token_ids)))  # end_token_ids
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.min_tokens,
                                       params.include_stop_str_in_output, params.skip_special_tokens)
        seq = Sequence(request_id, list(prompt_ids), params, detok, mm=mm)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has nothing before it
        if params.structured is not None:  # structured outputs: the sequence's grammar state
            seq.constraint = Constraint(params.structured)
        if not params.greedy:
            # without a seed: the engine seed's key for this request's arrival number, so --seed N makes a
            # run's sampled answers repeat after a restart (vLLM's --seed), and no two requests share one
            seq.sample_key = params.seed if params.seed is not None else \
                sampler.mix_key(self.ecfg.seed, next(self._arrivals))
            seq.generator = sampler.make_generator(seq.sample_key)
            if params.seed is not None:  # each position sampled by its own noise: the same text whatever is drafted
                seq.noise = sampler.PositionNoise(params.seed, self.model.head_size)
        self.waiting.append(seq)
        self.by_id[request_id] = seq

    def place_images(self, prompt_ids: list[int], images: list[ImageInput]) -> MultiModalPrompt:
        vision = self.target.vision
        if vision is None or not self.target.config.mrope_section:
            raise RequestError(f"model {self.target.name!r} does not read images (no vision tower; a GGUF "
                               "model takes one with --mmproj FILE)", param="messages", code="images_not_supported")
        try:
            return MultiModalPrompt.build(prompt_ids, images, vision.config.image_token_id)
        except ValueError as exc:
            raise RequestError(f"image placeholders: {exc}", param="prompt") from exc

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.by_id.get(request_id)
        if seq is None or seq.finished:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        return self._finish(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def idle(self) -> None:
        """Called while there is no work: raises ParallelError once a tensor-parallel rank is gone."""
        tp = self.model.tp
        if tp is not None and tp.failed is not None:
            raise tp.failed

    def close(self) -> None:
        """Release what outlives the object: a tensor-parallel group's worker processes."""
        if self.model.tp is not None:
            from specserve.parallel.launch import stop_workers

            stop_workers(self.model.tp)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), len(self.waiting), self.blocks.num_blocks, self.blocks.num_free,
                           self.num_preemptions)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        rows = self.schedule_step()
        return self.run_step(rows) if rows else []

    def schedule_step(self) -> list[ScheduledRow]:
        """The step's rows: waiting requests admitted, K/V blocks reserved (``stats`` now counts
        them running, which a server publishes before the forward: a long prefill chunk is not
        shown as waiting)."""
        self.scheduler.admit()
        if not self.running:
            return []
        spent_ms = self.encode_ahead() if self.runner.encoder is not None else 0.0
        return self.scheduler.schedule(drafting=self.drafter is not None, spent_ms=spent_ms)

    def run_step(self, rows: list[ScheduledRow]) -> list[RequestOutput]:
        """Drafts, one forward and its verification for the scheduled ``rows``."""
        self._propose([r for r in rows if r.decode])
        Scheduler.place(rows)
        out = self.runner.run(rows)
        return self._process(rows, out.logits, out.hidden)

    def encode_ahead(self) -> float:
        """Encode the running prompts' images before the steps that need them: all at once when no
        stream decodes, else block by block within the step budget (--max-step-ms), so a stream waits
        for a slice of an image, not a whole one. A prompt's chunks stop before its first image
        not encoded yet (``EncoderCache.computable``). Returns the milliseconds spent (the step's prefill chunks
        get what is left of the budget)."""
        images = [img for s in self.running if s.mm is not None and s.prefilling for img in self.runner.encoder.unencoded(s)]
        if not images:
            return 0.0
        decoding = any(not s.prefilling for s in self.running)
        budget, t0 = self.ecfg.max_step_ms / 1000.0, time.perf_counter()
        self.runner.encoder.work(images, t0 + budget if decoding and budget > 0 else None)
        return (time.perf_counter() - t0) * 1000.0 if decoding else 0.0

    def _propose(self, rows: list[ScheduledRow]) -> None:
        """Fill each decode row's drafts (at most the length the scheduler reserved room for)."""
        asked = [r for r in rows if r.num_drafts > 0] if self.drafter else []
        if not asked:
            return
        props = self.drafter.propose([r.seq for r in asked], [r.num_drafts for r in asked])
        for r, p in zip(asked, props):
            k = r.num_drafts
            p = cut_proposal(r.seq, Proposal(p.token_ids[:k], None if p.probs is None else p.probs[:k], p.cut))
            r.drafts, r.draft_probs, r.cut = p.token_ids, p.probs, p.cut  # structured outputs: drafts stay legal

    def _observe(self, r: ScheduledRow, start: int, count: int, hidden: dict[int, torch.Tensor]) -> None:
        """Hand the drafter the target's hidden states of the rows whose K/V were kept."""
        if self.drafter and self.drafter.hidden_layers and count:
            rows = slice(r.start, r.start + count)
            self.drafter.observe(r.seq, {k: v[rows] for k, v in hidden.items()}, list(range(start, start + count)))

    # ---- after the forward -----------------------------------------------------------------
    def _process(self, rows: list[ScheduledRow], logits: torch.Tensor,
                 hidden: dict[int, torch.Tensor]) -> list[RequestOutput]:
        outputs, cursor = [], 0
        for r in rows:
            if not r.decode:  # a prefill chunk: its rows that score prompt tokens come first
                cursor = self._record_prompt_logprobs(r.seq, r.count, logits, cursor)
            if not r.sample:  # a prefill chunk that does not end the prompt (or max_tokens 0: samples nothing)
                self._commit_chunk(r, hidden)
                if r.seq.params.max_tokens == 0 and not r.seq.prefilling:  # the prompt alone, for its logprobs
                    outputs.append(self._finish(r.seq, "length"))
                continue
            drafts = r.drafts or []
            lg = logits[cursor:cursor + 1 + len(drafts)]
            cursor += 1 + len(drafts)
            out = self._verify_row(r, drafts, lg, hidden)
            if out is not None:
                outputs.append(out)
        return outputs

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, count: int, logits: torch.Tensor, cursor: int) -> int:
        """Record the prompt logprobs a prefill chunk of ``count`` rows scored; returns the cursor
        past their logits rows."""
        positions = seq.prompt_logprob_positions(count)
        if positions:
            tokens = [seq.prompt_ids[p + 1] for p in positions]
            lg = logits[cursor:cursor + len(positions)]
            seq.prompt_logprobs += sampler.top_logprobs(lg, tokens, seq.params.prompt_logprobs, rank=True)
        return cursor + len(positions)

    def _commit_chunk(self, r: ScheduledRow, hidden: dict[int, torch.Tensor]) -> None:
        seq = r.seq
        self._observe(r, seq.num_computed, r.count, hidden)
        seq.num_computed += r.count
        self.cache.commit(seq)
        self.cache.advance(seq)

    def _verify_row(self, r: ScheduledRow, drafts: list[int], lg: torch.Tensor,
                    hidden: dict[int, torch.Tensor]) -> RequestOutput | None:
        """Verify a decode row (or the chunk that ends a prompt), keep the accepted tokens and
        roll every cache group back to them."""
        seq = r.seq
        computed_before = seq.num_computed if drafts or r.count == 1 else seq.num_computed + r.count - 1
        n_acc, new = self._verify(seq, lg, drafts, r.draft_probs)
        if drafts:
            seq.acceptance.record(len(drafts), n_acc)
            self.totals.record(len(drafts), n_acc)
        self.policy.learn(seq, len(drafts), n_acc, r.cut)  # no news without drafts or a cut
        first = seq.num_computed
        seq.num_computed = computed_before + 1 + n_acc
        self._observe(r, first, seq.num_computed - first, hidden)
        self.cache.rollback(seq)
        self.cache.advance(seq)
        if self.drafter:
            self.drafter.on_verified(seq, n_acc)
        return self._append(seq, new, lg)

    def _verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int],
                draft_probs: torch.Tensor | None) -> tuple[int, list[int]]:
        p = seq.params
        allowed = seq.constraint.masks(drafts, logits.shape[-1]) if seq.constraint else None  # structured outputs
        lg = sampler.penalize(logits, p, seq.prompt_ids, seq.output_ids, drafts, allowed)
        if p.greedy:
            return verify_greedy(lg, drafts)
        probs = sampler.probs_from_logits(lg, p)
        if seq.noise is not None:
            seq.noise.forget_before(len(seq.output_ids))
            return verify_keyed(probs, drafts, seq.noise, len(seq.output_ids))
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
                eos = tok in p.eos_token_ids and not p.ignore_eos  # EOS: no stop_reason, as in vLLM
                seq.stop_reason = (None if eos else tok) if stop_tok else seq.detok.stop_hit
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                break
        if p.logprobs is not None:
            seq.pending_logprobs += sampler.top_logprobs(logits[:len(kept)], kept, p.logprobs)
        seq.pending_ids += kept
        if seq.constraint is not None:  # structured outputs: the grammar moves past the kept tokens
            seq.constraint.commit(kept)
        self.cache.commit(seq)
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
            seq.acceptance if self.speculative else None,
            None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            seq.prefill_time(), seq.decode_time(), stop_reason=seq.stop_reason)
        seq.pending_ids, seq.pending_logprobs = [], []
        if seq.prompt_logprobs is not None and not seq.needs_prompt_logprobs:  # once: handed over, not kept
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        return out

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        seq.status, seq.finish_reason, seq.finished_at = Status.FINISHED, reason, time.perf_counter()
        self.policy.finished(seq, reason)
        if seq in self.running:
            self.running.remove(seq)
        if self.drafter:  # before the KV is freed: the drafter may keep state of the cached blocks
            self.drafter.on_finished(seq)
        self.cache.free(seq)
        self.by_id.pop(seq.request_id, None)
        return self._delta(seq, final=True)

    # ---- convenience -----------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "req-0",
                 images: list[ImageInput] | None = None):
        """Run one request to completion, yielding its deltas (for the CLI and tests)."""
        self.add_request(request_id, prompt_ids, params, images)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return


def plan_for(target: LoadedModel, ecfg: EngineConfig, spec: SpeculativeConfig | None, drafter: Drafter | None,
             total_memory: int | None = None, share: int | None = None) -> MemoryPlan:
    """The memory plan of an engine over target with this drafter (``specserve plan`` prints it).
    share: ranks sharing this machine's memory (default: a tensor-parallel driver's local ranks)."""
    model = target.model
    if share is None:
        share = ranks_sharing_memory(1 + len(model.tp.processes), model.device) if model.tp is not None else 1
    return engine_plan(ecfg, model.cfg, model.dtype, model.device, model.weight_bytes(),
                       drafter.weight_bytes() if drafter else 0, total_memory,
                       lookahead=(spec.num_speculative_tokens if spec else 0) + 1,
                       drafter_kv_bytes=drafter.kv_bytes() if drafter else 0,
                       vision=vision_memory(target, ecfg.encoder_cache_bytes), share=share)
