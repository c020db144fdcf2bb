"""MTP head drafter: DeepSeek-V3 / Qwen3-Next multi-token-prediction layout, chained for k steps.

One MTP step at position ``i`` combines the embedding of token ``x_i`` with the previous
hidden state ``h_{i-1}``::

    x   = eh_proj(cat(rms(embed(x_i), enorm), rms(h_{i-1}, hnorm)))      # 2H -> H
    g_i = decoder_layer(x)          # attention over the head's own cache + SwiGLU MLP
    p(x_{i+1}) = softmax(lm_head(rms(g_i, norm)))

* ``embed`` and ``lm_head`` are the target's (shared); ``norm`` starts as the target's final
  norm (a checkpoint's ``shared_head.norm`` / ``mtp.norm`` replaces it; training may adjust it).
* ``h`` for the first step is the target's **last-layer hidden state after the target's final
  norm** (the engine gives the drafter the last layer's output; the drafter applies the
  target's final norm to it: the convention vLLM uses for checkpoint MTP heads). Step s > 1
  uses the head's own output ``g`` of the previous step (before ``norm``), with the previous
  draft token: the chain.
* Cache: a row for position ``i`` (both ``h_{i-1}`` and ``x_i`` verified) is computed once,
  lazily at the next proposal, and its K/V kept in a per-sequence tensor (the last
  ``context_window`` rows, trimmed in chunks). Rows of draft positions (the chain) are never
  cached, so nothing needs rolling back after verification.
* Prefix caching: the rows of every full block the target registers in its prefix cache (and
  ``h`` of the block's last position) are kept in a ``PrefixStore`` under the block's chained
  hash, so a request that starts from cached blocks drafts as if it had computed them.

Weights come from (first match):

1. ``"model": DIR`` written by ``specserve train-drafter --method mtp`` (config.json with
   ``"drafter": "mtp"`` + model.safetensors);
2. ``"model": PATH`` or, without ``model``, the target's own checkpoint, when it ships an MTP
   head: safetensors ``mtp.*`` / ``model.mtp.*`` (Qwen3-Next names: ``fc``,
   ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm``, ``layers.0.*``; DeepSeek names
   ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm`` are accepted too), DeepSeek-V3's
   ``model.layers.{num_hidden_layers}.{eh_proj,enorm,hnorm,shared_head.norm,...}``, or GGUF
   ``blk.{N}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`` with the block's ordinary layer
   tensors (``attn_q``, ``ffn_gate``, ...); read by mtp_checkpoint.py. The layer is attention
   (gated with partial rotary for a Qwen3.5 / Qwen3-Next target) with a SwiGLU MLP or a mixture
   of experts (Qwen3-Next, from safetensors or GGUF); MLA layers are not supported.
"""

from __future__ import annotations

import json
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
from specserve.speculative.drafter_files import load_state, load_token_counts
from specserve.speculative.family_layer import (DrafterLayers, LayerShape, linear, linear_quant, sub_state,
                                                weight_format)
from specserve.speculative.layers import TargetHead, TrainableLayer, check_target, rms, target_identity
from specserve.speculative.drafter import Drafter, Proposal, pick_tokens
from specserve.speculative.mtp_checkpoint import config_from_state, read_checkpoint_mtp
from specserve.speculative.prefix_store import PrefixStore


@dataclass
class MTPConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    qk_norm: bool = False
    qkv_bias: bool = False
    context_window: int = 1024
    depth: int = 3  # chained steps used in training (inference chains as many as asked)
    target: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    source: str = "trained"  # "trained" | the checkpoint the head came from
    drafter: str = "mtp"
    output_gate: bool = False  # gated attention (Qwen3.5's heads)
    rotary_dim: int = 0  # partial rotary (0 = the whole head)
    moe: list | None = None  # [experts, top k, inter, shared inter, norm top k]: Qwen3-Next's MoE layer
    mrope_section: list | None = None  # the target's M-RoPE: image prompts give (t, h, w) positions

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "MTPConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def for_target(cls, target: LoadedModel, *, intermediate_size: int | None = None, depth: int = 3,
                   context_window: int = 1024) -> "MTPConfig":
        c = target.config
        return cls(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, intermediate_size or c.intermediate_size,
                   c.rms_eps, c.rope_theta, c.qk_norm, False, context_window, depth, target_identity(target))


class MTPModel(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.enorm = nn.Parameter(torch.ones(H))
        self.hnorm = nn.Parameter(torch.ones(H))
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = TrainableLayer(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                  cfg.rms_eps, cfg.rope_theta, cfg.qk_norm, cfg.qkv_bias, cfg.output_gate,
                                  cfg.rotary_dim, tuple(cfg.moe) if cfg.moe else None,
                                  tuple(cfg.mrope_section or ()))
        self.norm = nn.Parameter(torch.ones(H))

    def init_weights(self, final_norm: torch.Tensor | None, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            self.layer.o.weight.mul_(0.5)
            if self.layer.moe is None:
                self.layer.down.weight.mul_(0.5)
            if final_norm is not None:
                self.norm.copy_(final_norm.float())

    def fuse(self, emb: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_eps
        return self.eh_proj(torch.cat([rms(emb, self.enorm, eps), rms(prev, self.hnorm, eps)], dim=-1))

    def forward(self, emb: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor,
                extra_k: torch.Tensor | None, extra_v: torch.Tensor | None, mask: torch.Tensor | None):
        """emb/prev: [b, T, H] -> (g [b, T, H] before ``norm``, (k, v) of the rows)."""
        return self.layer(self.fuse(emb, prev), positions, extra_k, extra_v, mask, return_kv=True)

    def out_norm(self, g: torch.Tensor) -> torch.Tensor:
        return rms(g, self.norm, self.cfg.rms_eps)

    # ---- training ---------------------------------------------------------------------------
    def train_forward(self, emb: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor,
                      depth: int) -> list[torch.Tensor]:
        """Teacher-forced chain over whole sequences.

        emb: [b, T, H] embeddings of x_0..x_{T-1}; hidden: [b, T, H] target hidden (after the
        final norm) at positions 0..T-1; valid: [b, T] bool. Depth d (1-based) computes rows
        at positions i = d..T-1 from (x_i, G_{d-1}[i-1]) with G_0 = hidden, causal attention
        among the depth's rows (within context_window); row i predicts x_{i+1}.
        Returns [G_1, ..., G_depth], G_d: [b, T - d, H] (rows at positions d..T-1).
        """
        b, T, _ = emb.shape
        dev = emb.device
        outs, prev_src = [], hidden
        W = self.cfg.context_window
        for d in range(1, depth + 1):
            n = T - d
            if n <= 0:
                break
            pos = torch.arange(d, T, device=dev).expand(b, n)
            i = torch.arange(n, device=dev)
            causal = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < W)
            mask = causal[None] & valid[:, None, d:]
            mask = torch.cat([torch.zeros(b, n, 0, dtype=torch.bool, device=dev), mask], dim=-1)
            g, _ = self.forward(emb[:, d:], prev_src[:, :n], pos, None, None, mask)
            outs.append(g)
            prev_src = g
        return outs


# ---- inference: the head on the family's layer module -----------------------------------------
class MTPNet(nn.Module):
    """A loaded MTPModel at inference: its layer as the target family's module
    (speculative/family_layer.py: gated attention and MoE for a Qwen3.5 / Qwen3-Next head), its
    eh_proj as the family's Linear, over rows of one sequence ([T, H]). weights: "int8" (the CPU
    default) or "float32"."""

    def __init__(self, model: MTPModel, target: LoadedModel, weights: str):
        super().__init__()
        c, state, device = model.cfg, model.state_dict(), target.model.device
        quant = linear_quant(weights, device)
        self.cfg = c
        shape = LayerShape(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_eps,
                           c.rope_theta, c.qk_norm, c.qkv_bias, c.output_gate, c.rotary_dim,
                           tuple(c.moe) if c.moe else None, tuple(c.mrope_section or ()))
        self.eh_proj = linear(state["eh_proj.weight"], quant, device)
        self.enorm, self.hnorm, self.norm = (state[n].float().to(device) for n in ("enorm", "hnorm", "norm"))
        self.stack = DrafterLayers(shape, target.config, [sub_state(state, "layer.")], quant, device)

    def forward(self, emb: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor | None,
                ctx_v: torch.Tensor | None, causal: bool):
        """emb / prev: [T, H]; positions [T] (or [T, 3]); the kept rows ctx_k / ctx_v [C, kvh, D]
        -> (g [T, H] before ``norm``, the rows' own (k, v) [T, kvh, D])."""
        eps = self.cfg.rms_eps
        x = self.eh_proj(torch.cat([rms_norm(emb.float().contiguous(), self.enorm, eps),
                                    rms_norm(prev.float().contiguous(), self.hnorm, eps)], dim=-1))
        attention = self.stack.attention(ctx_k, ctx_v, causal)
        g = self.stack.run(0, x, positions, attention)
        return g, (attention.k, attention.v)

    def out_norm(self, g: torch.Tensor) -> torch.Tensor:  # [T, H] or [H]
        return rms_norm(g.reshape(-1, g.shape[-1]).contiguous(), self.norm, self.cfg.rms_eps).view_as(g)


# ---- the drafter ------------------------------------------------------------------------------
@dataclass
class _State:
    hidden: RowCache = field(default_factory=RowCache)  # [n, H] target hidden (after the final norm)
    kv: RowCache = field(default_factory=RowCache)  # the head's cached rows: K, V [r, kvh, D] each
    has_kv: bool = False  # rows were computed since the hidden states (re)started
    generator: torch.Generator | None = None
    stored: int = 0  # leading full blocks whose rows are in the prefix store
    vocab_seen: int = 0  # tokens of the sequence already added to the draft vocabulary
    last_h: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> hidden of its last position


def mtp_model(cfg: MTPConfig, state: dict, target: LoadedModel, where: str) -> MTPModel:
    """An MTPModel with ``state`` loaded (a checkpoint's head or a train-drafter export)."""
    model = MTPModel(cfg)
    if "norm" not in state:  # no shared-head norm of its own: the target's final norm
        state = {**state, "norm": target.model.final_norm.float().cpu()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpecserveError(f"MTP weights in {where} do not match the head's layout "
                             f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    return model


def load_mtp_model(directory: Path, target: LoadedModel) -> MTPModel:
    """The float32 MTP head a train-drafter directory holds, checked against ``target``."""
    raw, state = load_state(directory)
    if raw.get("drafter") != "mtp":
        raise SpecserveError(f"{directory} holds a {raw.get('drafter')!r} drafter, not 'mtp'")
    cfg = MTPConfig.from_json(raw)
    check_target(cfg.target, target, str(directory))
    return mtp_model(cfg, state, target, str(directory))


def rope_positions(seq: Sequence, start: int, n: int, device) -> torch.Tensor:
    """Rotary positions of tokens start .. start + n - 1: [n], or [n, 3] (t, h, w) for a prompt
    with images (the target's M-RoPE positions, engine/multimodal.py)."""
    if seq.mm is None:
        return torch.arange(start, start + n, device=device)
    return seq.mm.rope_rows(start, n).long().to(device)


class MTPDrafter(Drafter):
    name = "mtp"
    has_cost = True

    def __init__(self, model: MTPModel, target: LoadedModel, store: PrefixStore | None = None,
                 p_min: float = 0.0, weights: str = "float32", vocab: DraftVocab | None = None):
        """model: the head (float32); it runs as an MTPNet in ``weights`` ("int8" on CPU: the
        kernels' int8 format; "float32"). vocab: drafts from the target's LM head cut to a draft
        vocabulary (speculative/draft_vocab.py; None: the full head)."""
        self.vocab = vocab
        self.store = store  # None: prefix-cache hits start with no context
        self.p_min = p_min  # the chain stops at a draft whose top probability is under it
        self.net = MTPNet(model, target, weights)
        self.cfg = model.cfg
        self.head = TargetHead(target)
        self.final_norm = target.model.final_norm
        self.eps = target.config.rms_eps
        self.hidden_layers = (target.config.num_layers - 1,)
        self.step_time = 0.0

    @classmethod
    def load(cls, where: str | Path | None, target: LoadedModel, store: PrefixStore | None = None,
             p_min: float = 0.0, weights: str = "float32", draft_vocab_size: int | None = None) -> "MTPDrafter":
        """The head of a train-drafter directory, of a checkpoint at ``where``, or (None) of the
        target's own checkpoint. draft_vocab_size: cut the LM head the drafts come from to this many
        tokens (ranked by the directory's token counts if it has them, else by the standard
        library's), as dflash does."""
        counts = load_token_counts(Path(where).expanduser()) if draft_vocab_size and where else None
        vocab = cut_vocab(target.model, target.tokenizer, draft_vocab_size, counts)  # None: the full head
        if where:
            p = Path(where).expanduser()
            if p.is_dir() and (p / "config.json").is_file() and \
                    json.loads((p / "config.json").read_text()).get("drafter") == "mtp":
                return cls(load_mtp_model(p, target), target, store, p_min, weights, vocab)
            state, source = read_checkpoint_mtp(p)
            if not state:
                raise SpecserveError(f"{p} has no MTP head (no mtp.* / nextn tensors) and is not a drafter "
                                     "directory from `specserve train-drafter --method mtp`")
        else:
            state, source = read_checkpoint_mtp(target.resolved.path)
            if not state:
                raise SpecserveError(f"{target.name} ships no MTP head; train one with `specserve train-drafter "
                                     f"--model {target.name} --method mtp --out DIR` and pass "
                                     '\'{"method": "mtp", "model": DIR}\'')
        return cls(mtp_model(config_from_state(state, target, source), state, target, source), target, store,
                   p_min, weights, vocab)

    def weight_bytes(self) -> int:
        return self.module_bytes(self.net)

    def kv_bytes(self) -> int:
        """The prefix store at capacity: per token a k and v row, per block one hidden row (float32)."""
        if self.store is None:
            return 0
        c = self.cfg
        per_block = self.store.block_size * 2 * c.num_kv_heads * c.head_dim * 4 + c.hidden_size * 4
        return self.store.capacity * per_block

    def _state(self, seq: Sequence) -> _State:
        return self.seq_state(seq, _State)

    @torch.inference_mode()
    def observe(self, seq: Sequence, hidden: dict[int, torch.Tensor], positions: list[int]) -> None:
        if not positions:
            return
        st = self._state(seq)
        first = positions[0]
        h = rms(hidden[self.hidden_layers[0]], self.final_norm, self.eps)
        if self.store is not None:  # h of each block's last position: what a restore starts from
            bs = self.store.block_size
            for j in range((-first - 1) % bs, len(positions), bs):
                st.last_h[(first + j + 1) // bs - 1] = h[j].clone()
        if first < st.hidden.end:  # recompute (preemption): drop what follows
            st.hidden.truncate(first)
            st.kv.truncate(first)
        if not len(st.hidden) or first > st.hidden.end:  # start, or a gap
            st.hidden.reset(first, [h])
            st.has_kv = False
            self._restore(seq, st, first)
            return
        st.hidden.append([h])

    def _restore(self, seq: Sequence, st: _State, first: int) -> None:
        """A sequence whose first computed position is ``first`` (> 0: a prefix-cache hit) takes
        the rows of the cached blocks before it, and h of position first - 1, from the store."""
        if self.store is None or first == 0 or first % self.store.block_size:
            return
        bs = self.store.block_size
        lo, rows = self.store.chain(seq.block_hashes, seq.token_ids, first // bs, -(-self.cfg.context_window // bs))
        st.stored = first // bs
        if rows:
            st.kv.reset(max(lo * bs, 1))  # position 0 has no row (no h before it)
            for r in rows:
                st.kv.append([r[0], r[1]])
            st.has_kv = True
            h = st.hidden.parts()[0].clone()
            st.hidden.reset(first - 1, [rows[-1][2][None]])
            st.hidden.append([h])

    def _store_blocks(self, seq: Sequence, st: _State) -> None:
        """Keep the rows of full blocks the target registered in its prefix cache."""
        if self.store is None or not st.has_kv:
            return
        bs = self.store.block_size
        last = min(len(seq.block_hashes), st.kv.end // bs)
        k, v = st.kv.parts()
        for i in range(st.stored, last):
            lo = max(i * bs, 1)
            if st.kv.start > lo or i not in st.last_h:  # rows missing (a gap start): cannot keep it
                continue
            r = slice(lo - st.kv.start, (i + 1) * bs - st.kv.start)
            self.store.put(seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]),
                           [k[r].clone(), v[r].clone(), st.last_h[i]])
        for i in [i for i in st.last_h if i < last]:
            del st.last_h[i]
        st.stored = max(st.stored, last)

    def on_finished(self, seq: Sequence) -> None:
        if self.store is not None and self.name in seq.drafter_state:
            self._catch_up(seq)  # the last rows, so a follow-up turn finds its whole prefix
        seq.drafter_state.pop(self.name, None)

    @torch.inference_mode()
    def _catch_up(self, seq: Sequence) -> torch.Tensor | None:
        """Compute (and cache) the rows of every verified position up to the last token;
        return g of the last token's row [H] (the first draft's hidden), or None."""
        st = self._state(seq)
        p = seq.num_tokens - 1  # the last token; its row uses h_{p-1}
        h_start = st.hidden.start
        if not len(st.hidden) or st.hidden.end < p or p - 1 < h_start:
            return None
        lo = max(st.kv.end if st.has_kv else h_start + 1, h_start + 1)
        if lo > p:  # already computed (cannot happen in the engine's order, but be safe)
            lo = p
            st.kv.truncate(p)
        dev = self.head.model.device
        ids = torch.tensor(seq.token_ids[lo:p + 1], device=dev)
        emb = self.head.embed(ids)
        prev = st.hidden.parts()[0][lo - 1 - h_start:p - h_start]
        pos = rope_positions(seq, lo, p + 1 - lo, dev)
        if st.has_kv and len(st.kv):  # the new rows see the kept ones, and each other causally
            g, (k, v) = self.net(emb, prev, pos, *st.kv.parts(), causal=True)
            st.kv.append([k, v])
        else:
            g, (k, v) = self.net(emb, prev, pos, None, None, causal=True)
            st.kv.reset(lo, [k, v])
            st.has_kv = True
        self._store_blocks(seq, st)
        if len(st.kv) > self.cfg.context_window + CONTEXT_TRIM:
            st.kv.drop_front(len(st.kv) - self.cfg.context_window)
        keep_from = p - 1 - h_start  # only h_{p-1} onwards is needed later
        if keep_from > CONTEXT_TRIM:
            st.hidden.drop_front(keep_from)
        return g[-1]

    @torch.inference_mode()
    def _chain(self, seq: Sequence, g: torch.Tensor, k: int, generator) -> Proposal:
        st = self._state(seq)
        dev = self.head.model.device
        p = seq.num_tokens - 1
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        cut = False
        verified_end = st.kv.end  # the draft rows appended below are dropped again at the end
        if self.vocab is not None:
            self.vocab.add(seq.token_ids[st.vocab_seen:])  # the prompt, then tokens since the last draft
            st.vocab_seen = seq.num_tokens
        try:
            for s in range(k):
                logits = self.head.logits(self.net.out_norm(g)[None], self.vocab)  # (-inf outside a draft vocabulary)
                prop = pick_tokens(seq, logits, generator, earlier=drafts, p_min=self.p_min)
                if not prop.token_ids:
                    cut = True
                    break  # unsure (p_min): no further chain steps
                drafts += prop.token_ids
                if prop.probs is not None:
                    probs.append(prop.probs[0])
                if s == k - 1:
                    break
                emb = self.head.embed(torch.tensor([drafts[-1]], device=dev))
                pos = rope_positions(seq, p + 1 + s, 1, dev)
                g2, (nk, nv) = self.net(emb, g[None], pos, *st.kv.parts(), causal=False)
                st.kv.append([nk, nv])
                g = g2[-1]
        finally:
            st.kv.truncate(verified_end)
        return Proposal(drafts, torch.stack(probs) if probs else None, cut)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, num_tokens):
            if k <= 0:
                out.append(Proposal([]))
                continue
            t0 = time.perf_counter()
            g = self._catch_up(seq)
            out.append(Proposal([]) if g is None else self._chain(seq, g, k, self._state(seq).generator))
            dt = (time.perf_counter() - t0) / k
            self.step_time = dt if not self.step_time else 0.8 * self.step_time + 0.2 * dt
        return out

    def draft_cost(self, k: int) -> float:
        return self.step_time * k


def build(spec, target: LoadedModel, options, ecfg, max_model_len: int) -> MTPDrafter:
    from specserve.models.catalog import drafter_location

    where = drafter_location(spec.model) if spec.model else spec.model
    return MTPDrafter.load(where, target, PrefixStore.for_engine(ecfg), spec.draft_p_min,
                           weight_format(spec.quantization, "mtp"), spec.draft_vocab_size)
