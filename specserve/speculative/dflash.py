"""DFlash-style block drafter: one forward of a small transformer proposes a whole block.

Layout (after DFlash, "block diffusion for flash speculative decoding"):

* **No embedding table or LM head of its own.** Inputs are embedded with the target's
  table (``target.model.embed``); outputs go through the drafter's own final norm and then
  the target's LM head (``target.model.logits``).
* **Input block**: the last verified token followed by ``B - 1`` copies of a learned mask
  embedding, at positions ``p .. p + B - 1`` (``p`` = position of the last verified token).
  Inside the block attention is bidirectional (non-causal); the output at block row ``j``
  (1 <= j < B) is the draft for position ``p + j``. One forward gives ``B - 1`` drafts.
* **Conditioning**: the target's hidden states from a few layers spread from early to late
  (``target_layer_ids``) are concatenated, projected ``k*H -> H`` (``fc``) and RMS-normed
  (``hidden_norm``). In every drafter layer these context features are turned into extra
  keys/values (the layer's own k/v projections, rope at their real positions) placed in
  front of the block, so a block row sees the injected context of every verified token
  before the anchor plus the whole block.
* **Per-sequence cache**: the engine hands the drafter the target's hidden states of every
  token whose K/V it keeps (``observe``); the drafter queues them and, when the sequence next
  drafts, turns them in one batch into per-layer context K/V appended to a per-sequence tensor
  (steps where the adaptive policy drafts nothing pay almost nothing). Only kept tokens are ever observed,
  so nothing needs undoing after verification; a re-observed position (preemption and
  recompute) truncates the cache back to it. The cache keeps the last ``context_window``
  positions (default 1024, trimmed in chunks of 64, so a block sees between
  ``context_window`` and ``context_window + 64`` context positions); training uses the same
  window.
* **Prefix caching**: the target never recomputes a cached prefix, so its hidden states are
  never observed. The context K/V of every full block the target registers in its prefix cache
  are kept in a ``PrefixStore`` under the same chained hash; a sequence that starts from cached
  blocks gets its context back from there (up to ``context_window`` positions), and drafts as if
  it had computed the prefix itself.

Sampling: at temperature 0 the drafts are the argmax of the (penalized) draft logits. At
temperature > 0 each draft is sampled from the draft logits warped exactly like the target's
(``sampler.penalize`` counting the earlier drafts, then ``sampler.probs_from_logits``), and
those probabilities are returned with the proposal so rejection sampling stays exact.

The drafter is pure torch; its outputs need only be deterministic, because losslessness
comes from the target's verification.

A drafter directory holds ``config.json`` (``"drafter": "dflash"``, shapes, target identity,
layer ids, block size, ...) and ``model.safetensors``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import nn

from specserve.engine.cache.rows import CONTEXT_TRIM, RowCache
from specserve.engine.sequence import Sequence
from specserve.errors import SpecserveError
from specserve.models.layers import rms_norm
from specserve.models.loader import LoadedModel
from specserve.speculative.draft_vocab import DraftVocab, cut_vocab
from specserve.speculative.drafter import Drafter, Proposal, pick_tokens
from specserve.speculative.drafter_files import load_state, load_token_counts
from specserve.speculative.family_layer import (DrafterLayers, LayerShape, linear, linear_quant, sub_state,
                                                weight_format)
from specserve.speculative.prefix_store import PrefixStore
from specserve.speculative.layers import TargetHead, TrainableLayer, check_target, rms, spread_layers, target_identity


# ---- config + model ---------------------------------------------------------------------------
@dataclass
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 8
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    qk_norm: bool = False
    context_window: int = 1024
    target: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    drafter: str = "dflash"
    draft_vocab_size: int | None = None  # default cut of the LM head (None: the full head); see load()

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "DFlashConfig":
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        return cls(**d)

    @classmethod
    def for_target(cls, target: LoadedModel, *, num_layers: int = 1, block_size: int = 8,
                   num_target_layers: int = 3, intermediate_size: int | None = None,
                   context_window: int = 1024) -> "DFlashConfig":
        c = target.config
        if not 1 <= num_layers <= 5:
            raise SpecserveError(f"dflash drafter: 1 to 5 layers, got {num_layers}")
        if block_size < 2:
            raise SpecserveError(f"dflash drafter: block size must be >= 2, got {block_size}")
        return cls(c.hidden_size, num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                   intermediate_size or c.intermediate_size, spread_layers(c.num_layers, num_target_layers),
                   block_size, c.rms_eps, c.rope_theta, c.qk_norm, context_window, target_identity(target))


class DFlashModel(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        H, k = cfg.hidden_size, len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * H, H, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.mask_embedding = nn.Parameter(torch.zeros(H))
        self.layers = nn.ModuleList(TrainableLayer(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                 cfg.intermediate_size, cfg.rms_eps, cfg.rope_theta, cfg.qk_norm)
                                    for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(H))

    def init_weights(self, target_embed_std: float, final_norm: torch.Tensor | None, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        with torch.no_grad():
            self.mask_embedding.copy_(torch.randn(self.mask_embedding.shape, generator=g) * target_embed_std)
            for layer in self.layers:  # small residual branches at the start
                layer.o.weight.mul_(1 / math.sqrt(2 * len(self.layers)))
                layer.down.weight.mul_(1 / math.sqrt(2 * len(self.layers)))
            if final_norm is not None:
                self.norm.copy_(final_norm.float())

    def context(self, hidden_cat: torch.Tensor) -> torch.Tensor:
        """[..., k*H] concatenated target hidden states -> [..., H] context features."""
        return rms(self.fc(hidden_cat.float()), self.hidden_norm, self.cfg.rms_eps)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) of context features ctx [..., C, H] at positions [..., C]."""
        return [layer.kv(ctx, positions) for layer in self.layers]

    def block_input(self, anchor_emb: torch.Tensor) -> torch.Tensor:
        """anchor_emb [..., H] -> [..., B, H]: the anchor token then B-1 mask embeddings."""
        B = self.cfg.block_size
        masks = self.mask_embedding.expand(*anchor_emb.shape[:-1], B - 1, anchor_emb.shape[-1])
        return torch.cat([anchor_emb.unsqueeze(-2).float(), masks.float()], dim=-2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                mask: torch.Tensor | None) -> torch.Tensor:
        """x: [b, T, H] block inputs; ctx_kv per layer [b, C, kvh, D]; -> [b, T, H] final-normed."""
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, positions, ck, cv, mask)
        return rms(x, self.norm, self.cfg.rms_eps)

    # ---- training: many blocks per sequence, block-causal mask -------------------------------
    def train_forward(self, hidden_cat: torch.Tensor, anchor_emb: torch.Tensor, anchors: torch.Tensor,
                      valid_ctx: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_cat: [b, T, k*H] target hidden states of the sequences; anchors: [b, m]
        anchor positions; anchor_emb: [b, m, H] embeddings of the anchor tokens.

        Block i of a sequence sits at positions a_i .. a_i + B - 1 and may attend to the
        injected context at positions [a_i - context_window, a_i) and to the whole of its own
        block, never to other blocks. Returns final-normed outputs [b, m, B, H].
        """
        b, T, _ = hidden_cat.shape
        m, B = anchors.shape[1], self.cfg.block_size
        dev = hidden_cat.device
        ctx_pos = torch.arange(T, device=dev).expand(b, T)
        ctx = self.context(hidden_cat)
        kv = self.context_kv(ctx, ctx_pos)
        x = self.block_input(anchor_emb).reshape(b, m * B, -1)
        offs = torch.arange(B, device=dev)
        pos = (anchors[:, :, None] + offs).reshape(b, m * B)
        mask = self.block_mask(anchors, T, valid_ctx)
        out = self.forward(x, pos, kv, mask)
        return out.reshape(b, m, B, -1)

    def block_mask(self, anchors: torch.Tensor, T: int, valid_ctx: torch.Tensor | None = None) -> torch.Tensor:
        """[b, m*B, T + m*B] bool: context j visible to block i iff a_i - W <= j < a_i; block rows
        visible iff in the same block."""
        b, m = anchors.shape
        B, W = self.cfg.block_size, self.cfg.context_window
        dev = anchors.device
        j = torch.arange(T, device=dev)
        a = anchors[:, :, None]  # [b, m, 1]
        ctx_ok = (j < a) & (j >= a - W)  # [b, m, T]
        if valid_ctx is not None:
            ctx_ok &= valid_ctx[:, None, :]
        ctx_ok = ctx_ok[:, :, None, :].expand(b, m, B, T).reshape(b, m * B, T)
        blk = torch.arange(m, device=dev).repeat_interleave(B)
        same = (blk[:, None] == blk[None, :]).expand(b, m * B, m * B)
        return torch.cat([ctx_ok, same], dim=-1)


def load_dflash_model(directory: Path, target: LoadedModel) -> DFlashModel:
    """The float32 DFlashModel a drafter directory holds (int8 exports dequantized), checked
    against ``target`` (vocabulary, hidden size, layers it reads)."""
    raw, state = load_state(directory)
    if raw.get("drafter") != "dflash":
        raise SpecserveError(f"{directory} holds a {raw.get('drafter')!r} drafter, not 'dflash'")
    cfg = DFlashConfig.from_json(raw)
    check_target(cfg.target, target, str(directory))
    if max(cfg.target_layer_ids) >= target.config.num_layers:
        raise SpecserveError(f"drafter {directory} reads target layer {max(cfg.target_layer_ids)}, but "
                             f"{target.name} has {target.config.num_layers} layers")
    model = DFlashModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpecserveError(f"{directory}/model.safetensors does not match its config "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model


# ---- the drafter ------------------------------------------------------------------------------
class DFlashNet(nn.Module):
    """A trained DFlashModel at inference: its layers as the target family's modules
    (speculative/family_layer.py), its projection as the family's Linear, over rows of one
    sequence ([T, H], not batched). weights: "int8" (the CPU default: a quarter of the float32
    bytes, activations quantized per row as the target's) or "float32"."""

    def __init__(self, model: DFlashModel, target: LoadedModel, weights: str):
        super().__init__()
        cfg, state, device = model.cfg, model.state_dict(), target.model.device
        quant = linear_quant(weights, device)
        self.cfg = cfg
        shape = LayerShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                           cfg.rms_eps, cfg.rope_theta, cfg.qk_norm)
        self.fc = linear(state["fc.weight"], quant, device)
        self.hidden_norm, self.norm = (state[n].float().to(device) for n in ("hidden_norm", "norm"))
        self.mask_embedding = state["mask_embedding"].float().to(device)
        self.stack = DrafterLayers(shape, target.config, [sub_state(state, f"layers.{i}.")
                                                           for i in range(cfg.num_layers)], quant, device)

    def context(self, hidden_cat: torch.Tensor) -> torch.Tensor:
        """[n, k*H] concatenated target hidden states -> [n, H] context features."""
        return rms_norm(self.fc(hidden_cat.float().contiguous()), self.hidden_norm, self.cfg.rms_eps)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) [n, kvh, D] of context features ctx [n, H] at positions [n]."""
        return [self.stack.keys_values(i, ctx, positions) for i in range(self.cfg.num_layers)]

    def block_input(self, anchor_emb: torch.Tensor) -> torch.Tensor:
        """anchor_emb [H] -> [B, H]: the anchor token then B-1 mask embeddings."""
        masks = self.mask_embedding.expand(self.cfg.block_size - 1, -1)
        return torch.cat([anchor_emb[None].float(), masks])

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> torch.Tensor:
        """x: [B, H] block inputs; ctx_kv per layer [C, kvh, D] (or Nones) -> [B, H] final-normed;
        the block attends to the context and to the whole block."""
        for i, (ck, cv) in enumerate(ctx_kv):
            x = self.stack.run(i, x, positions, self.stack.attention(ck, cv))
        return rms_norm(x, self.norm, self.cfg.rms_eps)


@dataclass
class _Ctx:
    rows: RowCache = field(default_factory=RowCache)  # context K of each layer, then V of each: [n, kvh, D]
    pending: list[tuple[torch.Tensor, list[int]]] = field(default_factory=list)  # observed, not yet ingested
    pending_rows: int = 0
    vocab_seen: int = 0  # tokens of the sequence already added to the draft vocabulary
    stored: int = 0  # leading full blocks whose context K/V are in the prefix store
    generator: torch.Generator | None = None

    @property
    def start(self) -> int:  # position of the first cached context row
        return self.rows.start

    @property
    def end(self) -> int:
        return self.rows.end


class DFlashDrafter(Drafter):
    name = "dflash"
    has_cost = True

    def __init__(self, model: DFlashModel, target: LoadedModel, vocab: DraftVocab | None = None,
                 store: PrefixStore | None = None, p_min: float = 0.0, weights: str = "float32"):
        """model: the trained (float32) drafter; it runs as a DFlashNet in ``weights`` ("int8" on
        CPU: the kernels' int8 format; "float32")."""
        self.net = DFlashNet(model, target, weights)
        self.p_min = p_min  # proposals stop at the first unsure draft (see pick_tokens)
        self.cfg = model.cfg
        self.head = TargetHead(target)
        self.vocab = vocab  # None: drafts come from the target's full LM head
        self.store = store  # None: prefix-cache hits start with no context
        self.hidden_layers = tuple(self.cfg.target_layer_ids)
        self.step_time = 0.0

    @classmethod
    def load(cls, directory: str | Path, target: LoadedModel, draft_vocab_size: int | None = None,
             weights: str = "float32", store: PrefixStore | None = None, p_min: float = 0.0) -> "DFlashDrafter":
        """A trained drafter. Its drafts come from the target's LM head cut to ``draft_vocab_size``
        tokens (default: the drafter's config; None there: the full head), ranked by the token
        counts of its training answers (``token_counts.safetensors``) or, without that file, of
        the standard-library corpus; tokens requests use join as they appear (``DraftVocab``).
        weights="int8" runs the drafter's linears in the CPU kernels' int8 format (CPU only; the
        speculative config's default there: a quarter of the bytes, same acceptance in our runs).
        store: where the context of prefix-cached blocks is kept (see the module doc)."""
        directory = Path(directory).expanduser()
        model = load_dflash_model(directory, target)
        # the speculative config's draft_vocab_size (the vocabulary's size: the full head) wins over the
        # drafter config's default
        size = draft_vocab_size or model.cfg.draft_vocab_size
        vocab = cut_vocab(target.model, target.tokenizer, size, load_token_counts(directory)) if size else None
        return cls(model, target, vocab, store, p_min, weights)

    def weight_bytes(self) -> int:
        return self.module_bytes(self.net)

    def kv_bytes(self) -> int:
        """The prefix store at capacity: per token, every layer's context k and v (float32)."""
        if self.store is None:
            return 0
        c = self.cfg
        return self.store.capacity * self.store.block_size * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4

    # ---- context cache ----------------------------------------------------------------------
    def _state(self, seq: Sequence) -> _Ctx:
        return self.seq_state(seq, _Ctx)

    def observe(self, seq: Sequence, hidden: dict[int, torch.Tensor], positions: list[int]) -> None:
        """Queue the rows; their context K/V are computed when the sequence next drafts (in one
        batch), so steps where the adaptive policy drafts nothing cost almost nothing here."""
        if not positions:
            return
        st = self._state(seq)
        h = torch.cat([hidden[i].float() for i in self.cfg.target_layer_ids], dim=-1)  # [n, k*H]
        st.pending.append((h, list(positions)))  # merged at flush: no per-step copy of the queue
        st.pending_rows += len(positions)
        if st.pending_rows > self.cfg.context_window + CONTEXT_TRIM:
            self._flush(seq, st)

    @torch.inference_mode()
    def _flush(self, seq: Sequence, st: _Ctx) -> None:
        runs: list[tuple[list[torch.Tensor], list[int]]] = []  # contiguous segments, merged
        for h, positions in st.pending:
            if runs and positions[0] == runs[-1][1][-1] + 1:
                runs[-1][0].append(h)
                runs[-1][1].extend(positions)
            else:
                runs.append(([h], list(positions)))
        for hs, positions in runs:
            self._ingest(seq, st, torch.cat(hs) if len(hs) > 1 else hs[0], positions)
        st.pending, st.pending_rows = [], 0

    def _ingest(self, seq: Sequence, st: _Ctx, h: torch.Tensor, positions: list[int]) -> None:
        """Append the context K/V of hidden rows h [n, k*H] at positions to the cache."""
        first = positions[0]
        if first < st.end:  # recompute after preemption: drop what follows
            st.rows.truncate(first)
        if not len(st.rows) or first > st.end:  # first rows, or a gap (prefix-cached prompt): start here
            st.rows.reset(first)
            self._restore(seq, st, first)
        pos = torch.tensor(positions, device=h.device)
        kv = self.net.context_kv(self.net.context(h), pos)
        st.rows.append([k for k, _ in kv] + [v for _, v in kv])
        self._store_blocks(seq, st)
        if len(st.rows) > self.cfg.context_window + CONTEXT_TRIM:
            st.rows.drop_front(len(st.rows) - self.cfg.context_window)

    def _restore(self, seq: Sequence, st: _Ctx, first: int) -> None:
        """A sequence whose first computed position is ``first`` (> 0: a prefix-cache hit) takes
        the context K/V of the cached blocks before it from the store (up to the window)."""
        if self.store is None or first == 0 or first % self.store.block_size:
            return
        bs = self.store.block_size
        want = -(-self.cfg.context_window // bs)
        lo, rows = self.store.chain(seq.block_hashes, seq.token_ids, first // bs, want)
        if rows:
            st.rows.reset(lo * bs)
            for r in rows:  # per block: K of each layer, then V of each
                st.rows.append(list(r))
        st.stored = first // bs

    def _store_blocks(self, seq: Sequence, st: _Ctx) -> None:
        """Keep the context K/V of full blocks the target registered in its prefix cache."""
        if self.store is None:
            return
        bs = self.store.block_size
        last = min(len(seq.block_hashes), st.end // bs)
        for i in range(max(st.stored, -(-st.start // bs)), last):
            r = i * bs - st.start
            self.store.put(seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]),
                           [x[r:r + bs].clone() for x in st.rows.parts()])
        st.stored = max(st.stored, last)

    def on_finished(self, seq: Sequence) -> None:
        st = seq.drafter_state.get(self.name)
        if self.store is not None and st is not None and st.pending:
            self._flush(seq, st)  # the last blocks, so a follow-up turn finds its whole prefix
        seq.drafter_state.pop(self.name, None)

    # ---- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def block_hidden(self, seq: Sequence) -> torch.Tensor:
        """Final-normed drafter outputs [B, H] for the block anchored at the last token."""
        st = self._state(seq)
        self._flush(seq, st)
        p = seq.num_tokens - 1
        dev = self.head.model.device
        anchor = self.head.embed(torch.tensor([seq.token_ids[-1]], device=dev))[0]
        x = self.net.block_input(anchor)  # [B, H]
        pos = torch.arange(p, p + self.cfg.block_size, device=dev)
        n, layers = min(st.end, p) - st.start, self.cfg.num_layers
        if len(st.rows) and n > 0:  # context: the cached positions before the anchor
            parts = st.rows.parts()
            kv = [(parts[i][:n], parts[layers + i][:n]) for i in range(layers)]
        else:  # no context yet (should not happen: the prompt is observed first)
            kv = [(None, None)] * layers
        return self.net(x, pos, kv)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, num_tokens):
            if k <= 0:
                out.append(Proposal([]))
                continue
            t0 = time.perf_counter()
            k = min(k, self.cfg.block_size - 1)
            h = self.block_hidden(seq)[1:1 + k]
            st = self._state(seq)
            if self.vocab is not None:
                self.vocab.add(seq.token_ids[st.vocab_seen:])  # the prompt, then tokens since the last draft
                st.vocab_seen = seq.num_tokens
            logits = self.head.logits(h, self.vocab)  # [k, V] (-inf outside a draft vocabulary)
            out.append(pick_tokens(seq, logits, st.generator, p_min=self.p_min))
            dt = time.perf_counter() - t0
            self.step_time = dt if not self.step_time else 0.8 * self.step_time + 0.2 * dt
        return out

    def draft_cost(self, k: int) -> float:
        # one forward yields the whole block: any k costs one forward
        return self.step_time if k > 0 else 0.0


def build(spec, target: LoadedModel, options, ecfg, max_model_len: int) -> DFlashDrafter:
    if not spec.model:
        raise SpecserveError('speculative config: method "dflash" needs "model" (a drafter directory '
                             "written by `specserve train-drafter --method dflash`)")
    from specserve.models.catalog import drafter_location

    where = drafter_location(spec.model)
    weights = weight_format(spec.quantization, "dflash")
    return DFlashDrafter.load(where, target, spec.draft_vocab_size, weights, PrefixStore.for_engine(ecfg),
                              spec.draft_p_min)
