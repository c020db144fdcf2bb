"""One decoder-only transformer for Llama/SmolLM2/Mistral, Qwen2/2.5, Qwen3 and Gemma 3.

The forward pass takes an explicit :class:`ForwardBatch` (no global context): any mix of
prefill chunks, decode tokens and verification blocks of several sequences, all reading and
writing the paged KV cache through their block tables.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from specserve.errors import ModelLoadError, SpecserveError
from specserve.kernels import ops
from specserve.models.config import ModelConfig
from specserve.models.embedding import TokenEmbedding
from specserve.models.fused import FusedStack
from specserve.models.kv_cache import KVCache  # noqa: F401  (re-exported: the paged KV cache)
from specserve.models.layers import Linear, Rope, act_mul, linears, paged_attention, rms_norm
from specserve.models.weights import RawTensor
from specserve.parallel.group import Op
from specserve.parallel.shard import vocab_rows


@dataclass(frozen=True)
class Paging:
    """One paged cache group's part of a forward (engine/cache: group 0 is the full-attention
    pool; a model whose sliding-window layers have a pool of their own adds group 1)."""

    block_tables: torch.Tensor  # [S, max_blocks] int32, each sequence's block ids
    slot_mapping: torch.Tensor  # [T] int64, the flat slot each row writes (block * block_size + offset)


@dataclass
class ForwardBatch:
    """Where each token of a forward pass sits. T = tokens in the pass, S = sequences."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int32, absolute position in its sequence
    seq_ids: torch.Tensor  # [T] int32, row of each group's block_tables
    paging: tuple[Paging, ...]  # per paged cache group, in group order (KVCache.group(i): layer i's)
    logits_indices: torch.Tensor  # [L] int64, rows whose logits are wanted
    hidden_layers: tuple[int, ...] = ()  # layers whose output hidden states are returned
    # hybrid models' recurrent states (models/hybrid.py; None: the model keeps none)
    state_slots: torch.Tensor | None = None  # [S] int64, each sequence's state slot
    state_read: torch.Tensor | None = None  # [S] int64, the plane its step starts from (-1: zeros)
    state_write: torch.Tensor | None = None  # [T] int64, the plane receiving the state after a row (-1: none)
    state_ckpt_read: torch.Tensor | None = None  # [S] int64, a prefix-cache checkpoint to start from (-1: none)
    state_ckpt_write: torch.Tensor | None = None  # [T] int64, a checkpoint receiving the state after a row
    # images (engine/multimodal.py; None: text only): M-RoPE positions and encoder outputs
    rope_positions: torch.Tensor | None = None  # [T, 3] int32 (t, h, w), or [T] when every axis agrees
    mm_rows: torch.Tensor | None = None  # [N] int64, rows whose input is an image embedding
    mm_embeds: torch.Tensor | None = None  # [N, H] float32, those embeddings
    rope_table: object = field(default=None, repr=False, compare=False)  # the forward's M-RoPE rows, built once
    # the largest position, read from the device once per forward (device attention sizes its key range by it)
    max_position: int | None = field(default=None, repr=False, compare=False)

    TENSORS = ("input_ids", "positions", "seq_ids", "logits_indices", "state_slots", "state_read", "state_write",
               "state_ckpt_read", "state_ckpt_write", "rope_positions", "mm_rows", "mm_embeds")

    def to_tensors(self) -> list[torch.Tensor | None]:
        """The batch as tensors (what a tensor-parallel driver sends its workers): the fields of
        TENSORS, the hidden layers, then each paging group's tables and slots."""
        paging = [t for p in self.paging for t in (p.block_tables, p.slot_mapping)]
        return ([getattr(self, n) for n in self.TENSORS] + [torch.tensor(self.hidden_layers, dtype=torch.int64)]
                + paging)

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor | None]) -> "ForwardBatch":
        n = len(cls.TENSORS)
        fields, hidden, paging = tensors[:n], tensors[n], tensors[n + 1:]
        return cls(**dict(zip(cls.TENSORS, fields)), hidden_layers=tuple(hidden.tolist()),
                   paging=tuple(Paging(t, s) for t, s in zip(paging[::2], paging[1::2])))


@dataclass(frozen=True)
class HeadCut:
    """A tensor-parallel rank's part of a cut LM head (``Transformer.cut_head``)."""

    key: int
    local: Linear | None  # this rank's rows of them (None: none in its part of the vocabulary)
    counts: list[int]  # how many of the ids each rank holds, in rank order


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [L, vocab] float32
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, H]
    final_hidden: torch.Tensor | None = None  # [T, H] after the final norm


class LayerWeights:
    """Layer i's tensors turned into run-time linears and float32 norms."""

    def __init__(self, i: int, w: dict[str, RawTensor], quant: str, device, dtype, prefix: str = ""):
        self.i, self.w, self.quant, self.device, self.dtype = i, w, quant, device, dtype
        self.prefix = f"layers.{i}.{prefix}"  # prefix: a part of the layer (an expert: "expert3.")

    def part(self, prefix: str) -> "LayerWeights":
        return LayerWeights(self.i, self.w, self.quant, self.device, self.dtype, prefix)

    def lin(self, name: str, parallel: str = "replicated", quant: str | None = None) -> Linear:
        """The linear of tensor ``name``, in the layer's format or in ``quant`` ("none": float32)."""
        bias = self.w.get(f"{self.prefix}{name}_bias")
        return Linear(self.w[self.prefix + name], None if bias is None else bias.dequantize(), quant or self.quant,
                      self.device, self.dtype, parallel)

    def vec(self, name: str) -> torch.Tensor:
        """A norm weight or another per-channel vector, float32 on the device."""
        return self.w[self.prefix + name].dequantize().to(device=self.device, dtype=torch.float32).contiguous()

    def fuse(self, *names: str, parallel: str = "replicated") -> Linear | None:
        """One linear over several weights with the same input (None: their formats differ)."""
        biases = [self.w.get(f"{self.prefix}{n}_bias") for n in names]
        return Linear.fused([self.w[self.prefix + n] for n in names],
                            [None if b is None else b.dequantize() for b in biases], self.quant, self.device,
                            self.dtype, parallel)


class MLP(nn.Module):
    """The gated MLP of a decoder layer: down(act(gate(h)) * up(h)).

    Under tensor parallelism gate / up are column-parallel and down row-parallel: ``down`` sums
    the ranks' partial outputs itself ("row"), or leaves that to the owner ("row_partial": a
    mixture of experts sums its experts first)."""

    def __init__(self, lw: LayerWeights, activation: str, down: str = "row"):
        super().__init__()
        self.gate_up, self.activation = lw.fuse("gate", "up", parallel="column"), activation
        if self.gate_up is None:
            self.gate, self.up = lw.lin("gate", "column"), lw.lin("up", "column")
        self.down = lw.lin("down", down)

    def project_gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, H] -> gate, up: [T, intermediate] each."""
        if self.gate_up is not None:
            return self.gate_up(h).chunk(2, dim=-1)
        return self.gate(h), self.up(h)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down(act_mul(*self.project_gate_up(h), self.activation))

    __call__ = forward  # (as Linear: no hook dispatch)


def attend(cfg: ModelConfig, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
           kv: KVCache, window: int = 0) -> torch.Tensor:
    """Layer i's K/V rows k, v [T, Hkv, D] into the paged cache, then q [T, Hq, D] attending
    over it -> [T, Hq, D], through the paging of the cache group holding layer i's pool."""
    paging = batch.paging[kv.group(i)]
    kv.write(i, paging.slot_mapping, k, v)  # quantized on write for int8 / fp8 / int4 caches
    k_pool, v_pool, kv_extra = kv.attention_args(i)
    if q.device.type != "cpu":  # one host sync per forward, not one per layer
        if batch.max_position is None:
            batch.max_position = int(batch.positions.max())
        kv_extra = {**kv_extra, "max_position": batch.max_position}
    return paged_attention(q, k_pool, v_pool, paging.block_tables, batch.seq_ids, batch.positions, cfg.scale,
                           window, cfg.attn_softcap, **kv_extra)


class DecoderLayer(nn.Module):
    """One dense decoder layer: pre-norm attention over the paged KV cache (q/k/v biases, qk-norm,
    sliding window, Gemma's post-norms as the config says) and the gated MLP.

    ``fused_parts`` declares what the fused C path (models/fused.py) runs of it: the linears by
    slot, the norms, the window and the rope table; the C call is built from that alone."""

    def __init__(self, cfg: ModelConfig, i: int, w: dict[str, RawTensor], quant: str, device, dtype,
                 rope: Rope):
        super().__init__()
        lw = LayerWeights(i, w, quant, device, dtype)
        self.cfg, self.i, self.rope = cfg, i, rope
        self.qkv = lw.fuse("q", "k", "v", parallel="column")
        self.split_qkv = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        if self.qkv is None:
            self.q, self.k, self.v = lw.lin("q", "column"), lw.lin("k", "column"), lw.lin("v", "column")
        self.mlp = MLP(lw, cfg.activation)
        self.o = lw.lin("o", "row")
        self.attn_norm, self.ffn_norm = lw.vec("attn_norm"), lw.vec("ffn_norm")
        if cfg.qk_norm:
            self.q_norm, self.k_norm = lw.vec("q_norm"), lw.vec("k_norm")
        if cfg.sandwich_norms:
            self.post_attn_norm, self.post_ffn_norm = lw.vec("post_attn_norm"), lw.vec("post_ffn_norm")
        self.window = cfg.sliding_window if cfg.sliding(i) else 0

    def fused_parts(self) -> dict:
        """The layer as the fused C path takes it: linears by SSLayer slot (q holds q|k|v, gate
        holds gate|up when fused), norms by SSLayer field (None: absent), window, rope table."""
        mlp = self.mlp
        lins = {"o": self.o, "down": mlp.down}
        lins.update({"q": self.qkv} if self.qkv is not None else {"q": self.q, "k": self.k, "v": self.v})
        lins.update({"gate": mlp.gate_up} if mlp.gate_up is not None else {"gate": mlp.gate, "up": mlp.up})
        sandwich, qk = self.cfg.sandwich_norms, self.cfg.qk_norm
        norms = {"attn_norm": self.attn_norm, "ffn_norm": self.ffn_norm,
                 "q_norm": self.q_norm if qk else None, "k_norm": self.k_norm if qk else None,
                 "post_attn_norm": self.post_attn_norm if sandwich else None,
                 "post_ffn_norm": self.post_ffn_norm if sandwich else None}
        return {"linears": lins, "norms": norms, "window": self.window, "rope": self.rope}

    def unfuse_qkv(self) -> None:
        """Separate q, k, v linears (the fused one's rows, not re-quantized)."""
        if self.qkv is not None:
            cuts = torch.tensor((0, *self.split_qkv)).cumsum(0).tolist()
            self.q, self.k, self.v = (self.qkv.select_rows(torch.arange(a, b)) for a, b in zip(cuts, cuts[1:]))
            self.qkv = None

    def project_qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [T, H] -> q [T, q_size], k [T, kv_size], v [T, kv_size]."""
        if self.qkv is not None:
            return self.qkv(h).split(self.split_qkv, dim=-1)
        return self.q(h), self.k(h), self.v(h)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:  # [T, H] -> [T, H]
        def paged(q, k, v):
            return attend(self.cfg, self.i, q, k, v, batch, kv, self.window)

        return self.run(x, self.rope, batch.positions, paged)

    def run(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, attention) -> torch.Tensor:
        """The layer with attention(q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D] given: the paged
        cache (``forward``) or a drafter's own rows (speculative/family_layer.py). x: [T, H]."""
        cfg, t_len = self.cfg, x.shape[0]
        h = rms_norm(x, self.attn_norm, cfg.rms_eps)
        q, k, v = self.project_qkv(h)
        q = self._head_norm(q.reshape(t_len, cfg.num_heads, cfg.head_dim), "q_norm")
        k = self._head_norm(k.reshape(t_len, cfg.num_kv_heads, cfg.head_dim), "k_norm")
        a = attention(rope(q, positions), rope(k, positions), v.reshape(t_len, cfg.num_kv_heads, cfg.head_dim))
        o = self.o(a.reshape(t_len, cfg.q_size))  # summed over the ranks under tensor parallelism
        if cfg.sandwich_norms:
            o = rms_norm(o, self.post_attn_norm, cfg.rms_eps)
        x = x + o
        m = self.mlp(rms_norm(x, self.ffn_norm, cfg.rms_eps))
        if cfg.sandwich_norms:
            m = rms_norm(m, self.post_ffn_norm, cfg.rms_eps)
        return x + m

    def _head_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:  # [T, heads, D], qk-norm if any
        if not self.cfg.qk_norm:
            return x
        return rms_norm(x.reshape(-1, self.cfg.head_dim), getattr(self, name), self.cfg.rms_eps).view_as(x)

    def keys_values(self, h: torch.Tensor, rope: Rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values of already-normed rows h [T, H] -> [T, Hkv, D] each, without
        the queries (a dflash drafter's context rows; with q|k|v fused the queries are computed
        and dropped, so such a drafter calls ``unfuse_qkv`` first)."""
        cfg, t_len = self.cfg, h.shape[0]
        k, v = (self.project_qkv(h)[1:] if self.qkv is not None else (self.k(h), self.v(h)))  # (see unfuse_qkv)
        k = self._head_norm(k.reshape(t_len, cfg.num_kv_heads, cfg.head_dim), "k_norm")
        return rope(k, positions), v.reshape(t_len, cfg.num_kv_heads, cfg.head_dim)

    __call__ = forward  # (as Linear: no hook dispatch)


class Transformer(nn.Module):
    """Weights plus the forward pass: a declared stack of layer modules (``layers``), the token
    embedding, the final norm and the LM head.

    ``fused`` (default True): on CPU, run the decoder layers through one C call per forward
    (models/fused.py; bit-identical to the per-op Python path) whenever the model, the batch and
    the KV cache allow it; False always takes the Python path (``DecoderLayer.forward``)."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, RawTensor], quant: str, device: torch.device,
                 dtype: torch.dtype, norm_offset: float = 0.0, fused: bool = True,
                 norm_offset_skip: tuple[str, ...] = ()):
        super().__init__()
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self._stack: FusedStack | None = None
        # tensor parallel (specserve/parallel): this rank's group and its shard; None on one device
        self.tp, self.shard = None, None
        self.head_cuts: dict[int, HeadCut] = {}  # tensor parallel: cuts of the LM head by key
        tensors = _check_and_offset(tensors, self.required_tensors(cfg), norm_offset, norm_offset_skip)
        max_pos, rotary = cfg.max_position + 64, cfg.rotary_dim or cfg.head_dim
        self.rope_global = Rope(rotary, cfg.rope_theta, max_pos, device, cfg.rope_scaling_factor)
        self.rope_local = (Rope(rotary, cfg.rope_theta_local, max_pos, device)
                           if cfg.rope_theta_local else self.rope_global)
        self.layers = nn.ModuleList(self.build_layers(cfg, tensors, quant, device, dtype))
        # layers the C stack cannot run: no fused check on each forward
        self.fused = fused and self.fusable_layers()
        embed = tensors["embed"]
        head = tensors.get("lm_head") if not cfg.tie_embeddings or "lm_head" in tensors else None
        self.lm_head = Linear(head or embed, None, quant, device, dtype, "vocab")
        # [V, H], dequantized per row; tied: the head's blocks
        self.token_embedding = TokenEmbedding(embed, device, dtype, None if head else self.lm_head.weight)
        self.final_norm = tensors["norm"].dequantize().to(device=device, dtype=torch.float32)

    # ---- what a model class declares -------------------------------------------------------
    @staticmethod
    def required_tensors(cfg: ModelConfig) -> list[str]:
        return ["embed", "norm"] + [f"layers.{i}.{n}" for i in range(cfg.num_layers)
                                    for n in ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")]

    STACK = FusedStack  # the fused C path's class: its unsupported(model), batch_supported(batch, kv)

    def fusable_layers(self) -> bool:
        """Whether the fused C path knows this model's kind of layers."""
        return all(hasattr(layer, "fused_parts") for layer in self.layers)

    def build_layers(self, cfg: ModelConfig, tensors: dict[str, RawTensor], quant: str, device: torch.device,
                     dtype: torch.dtype) -> list:
        return [DecoderLayer(cfg, i, tensors, quant, device, dtype, self.rope_local if cfg.sliding(i)
                             else self.rope_global) for i in range(cfg.num_layers)]

    def attach_tensor_parallel(self, tp) -> None:
        """The tensor-parallel hook: this rank's process group (parallel/group.py) joins the
        model; every module declared "row" (a row-parallel linear, a mixture of experts) sums its
        output over the ranks with it, and embedding, LM head and the fused stack use it.
        None detaches it."""
        self.tp, self._stack = tp, None
        for module in self.modules():
            if getattr(module, "parallel", None) == "row":
                module.reduce_group = tp

    # ---- pieces drafters reuse -------------------------------------------------------------
    def mirrored(self, op: int, tensors):
        """Around a call a tensor-parallel driver makes: its workers make the same call (tensors:
        a function giving the call's arguments); a no-op on one device."""
        return contextlib.nullcontext() if self.tp is None else self.tp.lead(op, tensors)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        with self.mirrored(Op.EMBED, lambda: [ids]):
            x = self.token_embedding(ids) if self.tp is None else self._embed_vocab_parallel(ids)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def _embed_vocab_parallel(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """Each rank looks up the ids in its vocabulary rows, zeros elsewhere; the sum is exact."""
        start, rows = vocab_rows(self.cfg.vocab_size, self.shard)
        local = ids.long() - start
        inside = (local >= 0) & (local < rows)  # [T]
        x = self.token_embedding(torch.where(inside, local, 0))
        return self.tp.all_reduce(x.masked_fill(~inside[:, None], 0.0))

    def embed_batch(self, batch: ForwardBatch) -> torch.Tensor:  # -> [T, H]
        """The rows' token embeddings, image rows replaced by their encoder outputs."""
        x = self.embed(batch.input_ids)
        if batch.mm_rows is not None and batch.mm_rows.numel():
            x[batch.mm_rows] = batch.mm_embeds.to(x.dtype)
        return x

    @property
    def head_size(self) -> int:
        """Rows of the whole LM head (under tensor parallelism each rank holds a part of them)."""
        return self.cfg.vocab_size if self.tp is not None else self.lm_head.out_features

    def cut_head(self, ids: torch.Tensor, replaces: "Linear | HeadCut | None" = None,
                 key: int | None = None) -> "Linear | HeadCut":
        """The LM head restricted to vocabulary ids [n] (int64, ascending), for ``logits(h, cut)``
        (a draft vocabulary). One device: the selected rows. Tensor parallel: every rank keeps the
        rows of ids in its part of the vocabulary (the call is mirrored; the driver numbers the
        cut, ``key`` is that number on a worker); ``replaces``: an earlier cut every rank drops."""
        if self.tp is None:
            return self.lm_head.select_rows(ids)
        if key is None:
            key = max(self.head_cuts, default=-1) + 1
        drop = replaces.key if isinstance(replaces, HeadCut) else -1
        with self.mirrored(Op.CUT_HEAD, lambda: [torch.tensor([key, drop]), ids]):
            self.head_cuts.pop(drop, None)
            parts = [vocab_rows(self.cfg.vocab_size, replace(self.shard, rank=r)) for r in range(self.tp.world)]
            counts = [int(((ids >= a) & (ids < a + n)).sum()) for a, n in parts]
            start, rows = parts[self.shard.rank]
            mine = ids[(ids >= start) & (ids < start + rows)]
            local = self.lm_head.select_rows(mine - start) if mine.numel() else None
            self.head_cuts[key] = HeadCut(key, local, counts)
        return self.head_cuts[key]

    def logits(self, h: torch.Tensor, head: "Linear | HeadCut | None" = None) -> torch.Tensor:
        """[L, H] normed -> [L, V] float32 (with ``head``: a cut of the head, ``cut_head``: [L, n])."""
        cut = head if isinstance(head, HeadCut) else None
        with self.mirrored(Op.LOGITS, lambda: [h, None if cut is None else torch.tensor([cut.key])]):
            if cut is not None:
                out = self._gather_cut(h, cut)
            else:
                out = (self.lm_head if head is None else head)(h).float()
                if self.tp is not None:
                    if head is not None:
                        raise SpecserveError("a tensor-parallel LM head is cut with cut_head")
                    out = self._gather_vocab(out)
        if self.cfg.final_softcap:
            c = self.cfg.final_softcap
            out = torch.tanh(out / c) * c
        return out

    def _gather_cut(self, h: torch.Tensor, cut: "HeadCut") -> torch.Tensor:  # [L, H] -> [L, n]
        """Each rank's logits of its rows of the cut, gathered in id order (the ranks' parts of
        the vocabulary are ascending runs, so rank order is id order)."""
        width = max(cut.counts)
        out = h.new_zeros((h.shape[0], width), dtype=torch.float32)
        if cut.local is not None:
            out[:, :cut.local.out_features] = cut.local(h).float()
        parts = self.tp.all_gather_cat(out).split(width, dim=-1)
        return torch.cat([p[:, :n] for p, n in zip(parts, cut.counts)], dim=-1)

    def _gather_vocab(self, out: torch.Tensor) -> torch.Tensor:  # [L, V / world] -> [L, V]
        per = -(-self.cfg.vocab_size // self.tp.world)
        if out.shape[1] < per:  # the last rank's rows, padded to the others'
            out = torch.nn.functional.pad(out, (0, per - out.shape[1]))
        return self.tp.all_gather_cat(out)[:, :self.cfg.vocab_size]

    def weight_bytes(self) -> int:
        return sum(lin.nbytes() for lin in linears(self)) + self.token_embedding.nbytes()

    @property
    def embed_table(self) -> torch.Tensor:  # [V, H]: the whole table, dequantized (training reads it)
        return self.token_embedding.table()

    # ---- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> ForwardOutput:
        with self.mirrored(Op.FORWARD, batch.to_tensors):
            x = self.embed_batch(batch)  # [T, H]
            x, hidden = self.run_layers(x, batch, kv)
            h = rms_norm(x, self.final_norm, self.cfg.rms_eps)  # [T, H]
            logits = self.logits(h[batch.logits_indices])
        return ForwardOutput(logits, hidden, h)

    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> tuple[torch.Tensor, dict]:
        """The decoder layers over x [T, H] -> (x, hidden states of batch.hidden_layers)."""
        stack = self.fused_stack(batch, kv)
        if stack is not None:
            return x, stack.run(x, batch, kv)  # x updated in place
        hidden = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, kv)
            if i in batch.hidden_layers:
                hidden[i] = x
        return x, hidden

    def fused_stack(self, batch: ForwardBatch, kv: KVCache) -> FusedStack | None:
        """The fused layer stack when this forward can use it, else None (Python path)."""
        if not self.fused or not self.STACK.batch_supported(batch, kv):
            return None
        lib = ops.decoder_library()  # None: the torch kernels are selected (or no compiler)
        if lib is None:
            return None
        if self._stack is None or self._stack.lib is not lib:
            if self.STACK.unsupported(self) is not None:
                return None
            self._stack = self.STACK(self, lib)
        return self._stack


def _check_and_offset(tensors: dict[str, RawTensor], needed: list[str], norm_offset: float,
                      skip: tuple[str, ...] = ()) -> dict[str, RawTensor]:
    """Fail early on missing tensors; fold a (1 + w) norm offset into the norm weights (Gemma's,
    Qwen3.5's zero-centred norms), except the norms named in skip."""
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    if not norm_offset:
        return tensors
    out = dict(tensors)
    for name, raw in tensors.items():
        if (name == "norm" or name.endswith("norm")) and not name.endswith(skip or ("\0",)):
            out[name] = RawTensor(name, raw.shape, "torch", raw.dequantize() + norm_offset)
    return out
