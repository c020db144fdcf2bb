"""The model runner: the one place a forward batch is built, and the forward pass itself.

``build_forward_batch`` turns per-sequence entries (tokens, first position, block ids of each
paged cache group) into a :class:`ForwardBatch`; the engine's :class:`ModelRunner`, the draft
model and the training-data capture all build their batches with it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specserve.engine.cache import CacheCoordinator
from specserve.engine.multimodal import EncoderCache, MultiModalPrompt, text_positions
from specserve.engine.scheduler import ScheduledRow
from specserve.engine.step_budget import batch_keys
from specserve.kernels.tune import HintTrial
from specserve.models.transformer import ForwardBatch, ForwardOutput, KVCache, Paging
from specserve.speculative.adaptive import CostModel

log = logging.getLogger("specserve.engine")


@dataclass
class BatchEntry:
    """One sequence's rows in a forward pass."""

    tokens: list[int]
    start: int  # position of tokens[0]
    tables: list[list[int]]  # block ids of each paged cache group (group 0: the growing pool)
    # recurrent state: (slot, plane read or -1, plane per row or -1, checkpoint read or -1, checkpoint per row or -1)
    state: tuple | None = None
    rope: torch.Tensor | None = None  # [len(tokens), 3] int32 M-RoPE positions (None: start.. on every axis)
    embeds: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first row, [n, H]) image rows


def build_forward_batch(entries: list[BatchEntry], block_size: int, max_blocks: int, logit_rows: list[int],
                        device: torch.device, hidden_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """The batch of ``entries`` in order; logits are computed for ``logit_rows``. Each paged
    cache group of the entries' tables (the full-attention pool, then a sliding-window pool of
    its own where the model has one) becomes one :class:`Paging` of the batch."""
    ids, pos, sids = [], [], []
    num_groups = len(entries[0].tables) if entries else 1
    groups = [([], torch.zeros((len(entries), max_blocks), dtype=torch.int32)) for _ in range(num_groups)]
    bs = block_size
    for i, e in enumerate(entries):
        p = range(e.start, e.start + len(e.tokens))
        ids += e.tokens
        pos += p
        sids += [i] * len(e.tokens)
        for (slots, tables), blocks in zip(groups, e.tables, strict=True):
            slots += [blocks[x // bs] * bs + x % bs for x in p]  # HOLE (-1) entries are never written
            tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    paging = tuple(Paging(tables.to(device), torch.tensor(slots, dtype=torch.int64, device=device))
                   for slots, tables in groups)
    states = [None] * 5
    if entries and entries[0].state is not None:
        per_seq = [torch.tensor([e.state[f] for e in entries], dtype=torch.int64) for f in (0, 1, 3)]
        per_row = [torch.tensor([p for e in entries for p in e.state[f]], dtype=torch.int64) for f in (2, 4)]
        states = [per_seq[0], per_seq[1], per_row[0], per_seq[2], per_row[1]]
    rope, mm_rows, mm_embeds = _multimodal(entries, device)
    return ForwardBatch(
        rope_positions=rope, mm_rows=mm_rows, mm_embeds=mm_embeds,
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int32, device=device),
        seq_ids=torch.tensor(sids, dtype=torch.int32, device=device),
        paging=paging,
        logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=device),
        hidden_layers=hidden_layers,
        state_slots=states[0], state_read=states[1], state_write=states[2], state_ckpt_read=states[3],
        state_ckpt_write=states[4],
    )


def _multimodal(entries: list[BatchEntry], device: torch.device):
    """The batch's rotary positions and image rows / embeddings (all None: text only). The
    positions are [T, 3] (t, h, w) when a row is an image token, else [T]: after an image every
    axis moves together (``index + delta``), so decode steps keep the 1-D rotary table."""
    if not any(e.rope is not None for e in entries):
        return None, None, None
    rope, rows, embeds, at = [], [], [], 0
    for e in entries:
        rope.append(e.rope if e.rope is not None else text_positions(e.start, len(e.tokens)))
        for first, emb in e.embeds:
            rows.append(torch.arange(at + first, at + first + emb.shape[0]))
            embeds.append(emb)
        at += len(e.tokens)
    rope = torch.cat(rope)  # [T, 3]
    if not rows and bool((rope == rope[:, :1]).all()):
        return rope[:, 0].to(torch.int32).contiguous().to(device), None, None
    rope = rope.to(torch.int32).to(device)
    return (rope, None, None) if not rows else (rope, torch.cat(rows).to(device), torch.cat(embeds).to(device))


def logit_rows(rows: list[ScheduledRow]) -> list[int]:
    """Rows whose logits are needed, in order: a prefill chunk's rows that score prompt tokens
    (prompt logprobs); verification's: every row of a decode (the last token and each draft), the
    last row of the chunk that ends a prompt."""
    out: list[int] = []
    for r in rows:
        if not r.decode:
            out += [r.start + p - r.seq.num_computed for p in r.seq.prompt_logprob_positions(r.count)]
        if r.sample:
            out += range(r.start + (r.count - 1 if not r.decode and r.count > 1 else 0), r.start + r.count)
    return out


class ModelRunner:
    """Runs the target over a step's scheduled rows and times each pass into ``cost``."""

    def __init__(self, model, kv: KVCache, cache: CacheCoordinator, block_size: int, max_blocks: int,
                 cost: CostModel, hidden_layers: tuple[int, ...] = (), encoder: EncoderCache | None = None,
                 hint: HintTrial | None = None):
        self.model, self.kv, self.cache, self.encoder = model, kv, cache, encoder
        self.block_size, self.max_blocks = block_size, max_blocks
        self.cost, self.hidden_layers = cost, hidden_layers
        self.hint = hint  # the prefetch hint's trial, then its choice, set before each forward

    def entry(self, r: ScheduledRow) -> BatchEntry:
        seq = r.seq
        toks = ([seq.token_ids[seq.num_computed]] + r.drafts if r.decode
                else seq.token_ids[seq.num_computed:seq.num_computed + r.count])
        entry = BatchEntry(toks, seq.num_computed, self.cache.block_tables(seq), self.cache.state_entry(seq, r))
        if seq.mm is not None:
            self.add_images(entry, seq.mm)
        return entry

    def add_images(self, entry: BatchEntry, mm: MultiModalPrompt) -> None:
        """The entry's M-RoPE positions and the encoder rows of the images it covers (a chunk may
        start or end inside an image: its slice of the image's cached encoder output)."""
        entry.rope = mm.rope_rows(entry.start, len(entry.tokens))
        for img, a, b in mm.overlapping(entry.start, len(entry.tokens)):
            if self.encoder is None:
                raise RuntimeError("a prompt with images reached a model runner without a vision encoder")
            entry.embeds.append((a - entry.start, self.encoder.get(img)[a - img.offset:b - img.offset]))

    def batch(self, rows: list[ScheduledRow]) -> ForwardBatch:
        return build_forward_batch([self.entry(r) for r in rows], self.block_size, self.max_blocks,
                                   logit_rows(rows), self.model.device, self.hidden_layers)

    def run(self, rows: list[ScheduledRow], timed: bool = True) -> ForwardOutput:
        batch = self.batch(rows)
        n = int(batch.input_ids.shape[0])
        if timed and self.hint is not None:
            self.hint.before()
        t0 = time.perf_counter()
        out = self.model.forward(batch, self.kv)
        if timed:
            seconds = time.perf_counter() - t0
            self.cost.add(n, seconds, keys=batch_keys(batch.positions))
            if self.hint is not None:
                self._hint_after(n, seconds)
        return out

    def _hint_after(self, n: int, seconds: float) -> None:
        rec = self.hint.after(n, seconds)
        if rec is not None:
            log.info("weight prefetch: %s (measured over %d pairs of forwards, median t0/t1 %s)",
                     rec["prefetch"], rec["pairs"], rec["t0_over_t1"])
