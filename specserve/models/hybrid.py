"""Hybrid decoders (Qwen3.5 / Qwen3.6 / Qwen3.8, Qwen3-Next): Gated DeltaNet layers and gated
attention, with dense or mixture-of-experts MLPs.

A linear-attention layer keeps, per sequence, a conv window and a delta-rule state of fixed size
(float32) instead of K/V. They live in ``KVCache.states``, indexed by (slot, plane): a step reads
each sequence's committed plane (``ForwardBatch.state_read``; -1 = the zero state before token
0) and writes the state after a row to that row's plane (``ForwardBatch.state_write``), which the
cache coordinator's recurrent manager hands out, so rollback to an accepted draft count is an
index move. The full-attention layers use the paged KV cache like every other family.

Every reduction goes through batch-invariant kernels (linears, norms, attention, the DeltaNet
kernel that runs a sequence's rows token by token), so a sequence's tokens do not depend on the
batch, on chunking or on speculation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.errors import ModelLoadError
from specserve.kernels import ops
from specserve.kernels.grouped import groupable, linear_group, moe_combine, moe_route
from specserve.models.config import ModelConfig
from specserve.models.hybrid_fused import HybridStack
from specserve.models.layers import Rope, act_mul, expert_order, rms_norm
from specserve.models.transformer import MLP, ForwardBatch, KVCache, LayerWeights, Transformer, attend
from specserve.models.weights import RawTensor

ATTN_TENSORS = ("attn_norm", "q", "k", "v", "o", "q_norm", "k_norm")
LINEAR_TENSORS = ("attn_norm", "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_conv1d", "ssm_norm",
                  "ssm_out")  # and ssm_a or ssm_a_log, ssm_dt or ssm_dt_bias
MLP_TENSORS = ("ffn_norm", "gate", "up", "down")


@dataclass
class RecurrentStates:
    """Per linear-attention layer: conv windows [slots, planes, K-1, C] and delta-rule states
    [slots, planes, Hv, dk, dv], float32; and the prefix cache's checkpoints of both
    ([checkpoints, K-1, C], [checkpoints, Hv, dk, dv])."""

    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    conv_ckpt: dict[int, torch.Tensor]
    ssm_ckpt: dict[int, torch.Tensor]

    @classmethod
    def allocate(cls, cfg: ModelConfig, slots: int, planes: int, device: torch.device | str = "cpu",
                 checkpoints: int = 0) -> "RecurrentStates":
        dn = cfg.deltanet
        conv, ssm = (dn.conv_kernel - 1, dn.conv_dim), (dn.num_v_heads, dn.k_head_dim, dn.v_head_dim)

        def per_layer(*shape: int) -> dict[int, torch.Tensor]:
            return {i: torch.zeros(shape, device=device) for i in cfg.linear_layers}

        return cls(per_layer(slots, planes, *conv), per_layer(slots, planes, *ssm), per_layer(checkpoints, *conv),
                   per_layer(checkpoints, *ssm))

    def nbytes(self) -> int:
        tensors = (*self.conv.values(), *self.ssm.values(), *self.conv_ckpt.values(), *self.ssm_ckpt.values())
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class SeqState:
    """One sequence's rows and state planes in a forward (read once from the batch, used by every
    linear-attention layer)."""

    rows: tuple[int, int]  # its rows r0..r1 of the batch
    slot: int
    read: int  # the plane its rows start from (-1: the zero state)
    ckpt_read: int  # or this prefix-cache checkpoint (-1: none)
    writes: list[int]  # per row: the plane receiving the state after it (-1: none)
    ckpt_writes: list[int]  # per row: the checkpoint receiving it (-1: none)

    @staticmethod
    def of(batch: ForwardBatch) -> list["SeqState"]:
        if batch.state_slots is None:
            raise RuntimeError("a hybrid model's forward needs recurrent-state slots (ForwardBatch.state_*)")
        sid, writes, ckw = batch.seq_ids.tolist(), batch.state_write.tolist(), batch.state_ckpt_write.tolist()
        slots, reads, ckr = batch.state_slots.tolist(), batch.state_read.tolist(), batch.state_ckpt_read.tolist()
        out, r0 = [], 0
        for r in range(1, len(sid) + 1):  # a sequence's rows are contiguous
            if r == len(sid) or sid[r] != sid[r0]:
                s = sid[r0]
                out.append(SeqState((r0, r), slots[s], reads[s], ckr[s], writes[r0:r], ckw[r0:r]))
                r0 = r
        return out


class GatedAttention(nn.Module):
    """Full attention with a sigmoid gate on its output (q projection twice as wide, each head's
    query then gate), per-head q/k norms and partial rotary."""

    def __init__(self, cfg: ModelConfig, lw: LayerWeights):
        super().__init__()
        self.qkv = lw.fuse("q", "k", "v", parallel="column")  # one call where their formats allow
        if self.qkv is None:
            self.q, self.k, self.v = lw.lin("q", "column"), lw.lin("k", "column"), lw.lin("v", "column")
        self.o = lw.lin("o", "row")
        q_rows = self.qkv.out_features - 2 * cfg.kv_size if self.qkv is not None else self.q.out_features
        if q_rows != 2 * cfg.q_size:
            raise ModelLoadError(f"layer {lw.i}: gated attention wants a q projection of {2 * cfg.q_size} rows "
                                 f"(query and gate per head), the checkpoint has {q_rows}")
        self.q_norm, self.k_norm = lw.vec("q_norm"), lw.vec("k_norm")

    def forward(self, model: "HybridTransformer", i: int, h: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                seqs: list["SeqState"]) -> torch.Tensor:
        def paged(q, k, v):
            return attend(model.cfg, i, q, k, v, batch, kv)

        return self.run(model.cfg, h, *model.rope_of(batch), paged)  # partial rotary: the table covers rotary_dim

    def run(self, cfg: ModelConfig, h: torch.Tensor, rope: Rope, positions: torch.Tensor, attention) -> torch.Tensor:
        """h [T, H] (normed) -> [T, H], with attention(q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D]
        given: the paged cache (``forward``) or a drafter's own rows (speculative/family_layer.py)."""
        t_len, d = h.shape[0], cfg.head_dim
        if self.qkv is not None:  # [T, 2 q_size | kv_size | kv_size], views of one output
            qg, k, v = self.qkv(h).split((2 * cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        else:
            qg, k, v = self.q(h), self.k(h), self.v(h)
        qg = qg.view(t_len, cfg.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t_len, cfg.q_size)
        q = rms_norm(q.reshape(-1, d).contiguous(), self.q_norm, cfg.rms_eps).view(t_len, cfg.num_heads, d)
        k = rms_norm(k.reshape(-1, d), self.k_norm, cfg.rms_eps).view(t_len, cfg.num_kv_heads, d)
        v = v.view(t_len, cfg.num_kv_heads, d)
        attn = attention(rope(q, positions), rope(k, positions), v)  # [T, Hq, D]
        return self.o(ops.sigmoid_mul(gate, attn.reshape(t_len, cfg.q_size)))

    __call__ = forward  # (as Linear: no hook dispatch)


class GatedDeltaNet(nn.Module):
    """Linear attention: q/k/v through a causal depthwise conv and SiLU, the gated delta rule
    over a per-sequence state, a gated RMSNorm (norm(o) * w * silu(z)), the output projection."""

    def __init__(self, cfg: ModelConfig, lw: LayerWeights):
        super().__init__()
        dn = self.dn = cfg.deltanet
        ins = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")
        self.in_proj = lw.fuse(*ins, parallel="column")  # [C | z | b | a]
        self.zba = None
        if self.in_proj is None:  # q|k|v in another format (llama-quantize's mixes): z | b | a one call if they can be
            self.qkv = lw.lin(ins[0], "column")
            self.zba = lw.fuse(*ins[1:], parallel="column")
            if self.zba is None:
                self.z, self.b, self.a = (lw.lin(n, "column") for n in ins[1:])
        self.split = (dn.conv_dim, dn.value_dim, dn.num_v_heads, dn.num_v_heads)
        conv = lw.vec("ssm_conv1d").reshape(dn.conv_dim, -1)  # [C, 1, K] in the file
        if conv.shape[1] != dn.conv_kernel:
            raise ModelLoadError(f"layer {lw.i}: conv1d has {conv.shape[1]} taps, the config says {dn.conv_kernel}")
        self.conv_wt = conv.t().contiguous()  # [K, C]
        has = lambda n: f"layers.{lw.i}.{n}" in lw.w  # noqa: E731
        self.A = lw.vec("ssm_a") if has("ssm_a") else -torch.exp(lw.vec("ssm_a_log"))  # GGUF stores -exp(A_log)
        self.A = self.A.reshape(-1).contiguous()
        self.dt_bias = lw.vec("ssm_dt" if has("ssm_dt") else "ssm_dt_bias").reshape(-1).contiguous()
        self.norm, self.out = lw.vec("ssm_norm").reshape(-1), lw.lin("ssm_out", "row")
        if self.norm.numel() != dn.v_head_dim:
            raise ModelLoadError(f"layer {lw.i}: the gated norm has {self.norm.numel()} weights, the value "
                                 f"heads {dn.v_head_dim} dims")

    @staticmethod
    def state_io(i: int, st: RecurrentStates, q: "SeqState"):
        """A sequence's state in layer i: ((conv, ssm) to start from, or Nones for the zero state),
        (conv, ssm) outputs per row, and (checkpoint, plane) copies after the call."""
        start = ((st.conv_ckpt[i][q.ckpt_read], st.ssm_ckpt[i][q.ckpt_read]) if q.ckpt_read >= 0 else
                 (st.conv[i][q.slot, q.read], st.ssm[i][q.slot, q.read]) if q.read >= 0 else (None, None))
        conv_out, ssm_out, copies = [], [], []
        for p, c in zip(q.writes, q.ckpt_writes):
            plane = (st.conv[i][q.slot, p], st.ssm[i][q.slot, p]) if p >= 0 else None
            ckpt = (st.conv_ckpt[i][c], st.ssm_ckpt[i][c]) if c >= 0 else None
            dst = plane or ckpt or (None, None)
            conv_out.append(dst[0])
            ssm_out.append(dst[1])
            if plane and ckpt:
                copies += [(ckpt[0], plane[0]), (ckpt[1], plane[1])]
        return start, (conv_out, ssm_out), copies

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.in_proj is not None:
            return self.in_proj(h).split(self.split, dim=-1)
        if self.zba is not None:
            return (self.qkv(h), *self.zba(h).split(self.split[1:], dim=-1))
        return self.qkv(h), self.z(h), self.b(h), self.a(h)

    def forward(self, model: "HybridTransformer", i: int, h: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                seqs: list["SeqState"]) -> torch.Tensor:
        dn, t_len = self.dn, h.shape[0]
        qkv, z, b, a = self.project(h)
        core = torch.empty(t_len, dn.num_v_heads, dn.v_head_dim)
        heads = (dn.num_k_heads, dn.num_v_heads, dn.k_head_dim, dn.v_head_dim)
        for q in seqs:
            (conv_in, ssm_in), outs, copies = self.state_io(i, kv.states, q)
            r0, r1 = q.rows
            core[r0:r1] = ops.gated_delta(qkv[r0:r1], a[r0:r1], b[r0:r1], self.conv_wt, self.A, self.dt_bias, heads,
                                          conv_in, ssm_in, outs[0], outs[1], v_tiled=dn.v_tiled)
            for dst, src in copies:  # a row whose state goes to a plane and to a checkpoint
                dst.copy_(src)
        normed = rms_norm(core.view(-1, dn.v_head_dim), self.norm, model.cfg.rms_eps)  # [T * Hv, dv]
        gated = act_mul(z.reshape(-1, dn.v_head_dim).contiguous(), normed, "silu")  # silu(z) * norm(o) w
        return self.out(gated.view(t_len, dn.value_dim))

    __call__ = forward  # (as Linear: no hook dispatch)


class SparseMoE(nn.Module):
    """Mixture of experts: softmax router, the top k experts of each token (weights renormalised
    with norm_topk_prob), plus a shared expert scaled by sigmoid(shared gate). Each expert runs on
    the rows routed to it through the batch-invariant linears, and a token adds its experts'
    outputs in expert order, then the shared expert's (kernels/grouped.moe_combine), so a row's
    result does not depend on the other rows.

    Under tensor parallelism each expert's down projection gives a partial sum, and the module
    sums its whole output over the ranks once ("row")."""

    parallel = "row"

    def __init__(self, cfg: ModelConfig, lw: LayerWeights):
        super().__init__()
        # the router and the shared expert's gate stay float32 with float32 inputs (as llama.cpp keeps
        # them F32 and vLLM unquantized): int8 there moves which experts a token gets
        self.moe, self.router, self.reduce_group = cfg.moe, lw.lin("router", quant="none"), None
        self.experts = nn.ModuleList(MLP(lw.part(f"expert{e}."), cfg.activation, down="row_partial")
                                     for e in range(cfg.moe.num_experts))
        self.shared = (MLP(lw.part("shexp."), cfg.activation, down="row_partial")
                       if cfg.moe.shared_intermediate_size else None)
        self.shared_gate = lw.lin("shexp_gate", quant="none") if self.shared else None
        self._groupable: bool | None = None  # the routed experts in one call (can_group)
        self._fold_shared = False  # and the shared expert in the same call

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if h.shape[0] == 0:
            return torch.zeros_like(h)
        weight, chosen = moe_route(self.router(h), self.moe.num_experts_per_tok, self.moe.norm_topk_prob)
        y, idx = self.expert_outputs(h, chosen)  # [R, H], [T, k (+1)]
        gate = None if self.shared is None else self.shared_gate(h).reshape(-1)
        out = moe_combine(y, idx, weight, gate, impl="torch" if h.device.type != "cpu" else None)
        return out if self.reduce_group is None else self.reduce_group.all_reduce(out)

    __call__ = forward  # (as Linear: no hook dispatch)

    def can_group(self) -> bool:
        """Whether every routed expert's gate|up (and every down) can share one kernel call (asked
        once: all experts of a layer are in one format, so any subset can then)."""
        if self._groupable is None:
            ups, downs = [ex.gate_up for ex in self.experts], [ex.down for ex in self.experts]
            self._groupable = (all(u is not None and u.bias is None for u in ups) and all(d.bias is None for d in downs)
                               and groupable([u.weight for u in ups]) and groupable([d.weight for d in downs]))
            sh = self.shared
            self._fold_shared = (self._groupable and sh is not None and sh.gate_up is not None
                                 and sh.gate_up.bias is None and sh.down.bias is None
                                 and groupable([ups[0].weight, sh.gate_up.weight])
                                 and groupable([downs[0].weight, sh.down.weight]))
        return self._groupable

    def expert_outputs(self, h: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H], chosen [T, k] (each row's experts, ascending) -> (y [R, H]: every routed expert's
        output on its rows, then the shared expert's on all T; idx [T, k (+1)]: row t's outputs in y).
        On CPU all their gate|up projections are one kernel call and all their down projections
        another (kernels/grouped.py), with the same bits as one MLP call per expert."""
        t, k = chosen.shape
        if t == 1:  # one row: its experts in order, each on that row
            ids, sizes, xs = chosen[0].tolist(), [1] * k, [h] * k
            idx = torch.arange(k + (self.shared is not None)).view(1, -1)
        else:
            ids, sizes, order = expert_order(chosen)
            xs = list(h[order // k].split(sizes))  # each expert's rows, experts ascending
            idx = torch.empty_like(order)
            idx[order] = torch.arange(t * k)  # entry (row, slot) -> its output's row in y
            idx = idx.view(t, k)
            if self.shared is not None:
                idx = torch.cat([idx, torch.arange(t * k, t * k + t).view(t, 1)], dim=1)
        mlps = [self.experts[e] for e in ids]
        if h.device.type != "cpu" or not self.can_group():
            y = [ex(x) for ex, x in zip(mlps, xs)]
            return torch.cat(y if self.shared is None else [*y, self.shared(h)]), idx
        if self._fold_shared:  # the shared expert in the same calls, on all rows
            mlps, xs, sizes = [*mlps, self.shared], [*xs, h], [*sizes, t]
        both = linear_group(xs, [ex.gate_up.weight for ex in mlps],
                            torch.empty(sum(sizes), mlps[0].gate_up.out_features))
        act = act_mul(*both.chunk(2, dim=-1), mlps[0].activation)  # [R, I]
        y = linear_group(list(act.split(sizes)), [ex.down.weight for ex in mlps],
                         torch.empty(sum(sizes), mlps[0].down.out_features))
        return (y if self._fold_shared or self.shared is None else torch.cat([y, self.shared(h)])), idx


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, w: dict[str, RawTensor], quant: str, device, dtype):
        super().__init__()
        lw = LayerWeights(i, w, quant, device, dtype)
        self.mixer = GatedDeltaNet(cfg, lw) if cfg.is_linear(i) else GatedAttention(cfg, lw)
        self.mlp = SparseMoE(cfg, lw) if cfg.moe and cfg.moe.sparse(i) else MLP(lw, cfg.activation)
        self.attn_norm, self.ffn_norm = lw.vec("attn_norm"), lw.vec("ffn_norm")
        self.cfg = cfg

    def run(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, attention) -> torch.Tensor:
        """A gated-attention layer over x [T, H] with the attention given (see GatedAttention.run);
        the model's forward runs its layers through ``HybridTransformer.run_layers``."""
        eps = self.cfg.rms_eps
        x = x + self.mixer.run(self.cfg, rms_norm(x, self.attn_norm, eps), rope, positions, attention)
        return x + self.mlp(rms_norm(x, self.ffn_norm, eps))


class HybridTransformer(Transformer):
    """A decoder whose layers are Gated DeltaNet or gated full attention (``cfg.layer_types``).
    On the CPU its layers run in one C call per forward where they can (models/hybrid_fused.py,
    bit-identical to ``run_layers``' Python path; ``fused = False`` keeps the Python path)."""

    STACK = HybridStack

    def fusable_layers(self) -> bool:
        return True  # (a mixture of experts runs between C calls: HybridStack.breaks)

    @staticmethod
    def required_tensors(cfg: ModelConfig) -> list[str]:
        need = ["embed", "norm"]
        for i in range(cfg.num_layers):
            mixer = LINEAR_TENSORS if cfg.is_linear(i) else ATTN_TENSORS
            mlp = MLP_TENSORS
            if cfg.moe and cfg.moe.sparse(i):
                shared = ("shexp.gate", "shexp.up", "shexp.down", "shexp_gate") if cfg.moe.shared_intermediate_size else ()
                mlp = ("ffn_norm", "router", *shared, *(f"expert{e}.{p}" for e in range(cfg.moe.num_experts)
                                                         for p in ("gate", "up", "down")))
            need += [f"layers.{i}.{n}" for n in (*mixer, *mlp)]
        return need

    def build_layers(self, cfg, tensors, quant, device, dtype) -> list[HybridLayer]:
        if device.type != "cpu":
            raise ModelLoadError(f"{cfg.arch}: hybrid (linear-attention) models run on the CPU only so far; "
                                 "use --device cpu")
        for i in cfg.linear_layers:
            for names in (("ssm_a", "ssm_a_log"), ("ssm_dt", "ssm_dt_bias")):
                if not any(f"layers.{i}.{n}" in tensors for n in names):
                    raise ModelLoadError(f"checkpoint is missing tensor layers.{i}.{names[0]} "
                                         f"({'A_log' if names[0] == 'ssm_a' else 'dt_bias'})")
        return [HybridLayer(cfg, i, tensors, quant, device, dtype) for i in range(cfg.num_layers)]

    def rope_of(self, batch: ForwardBatch) -> tuple[Rope, torch.Tensor]:
        """The rotary table and positions of this forward (Rope.for_batch: with images, a per-row
        M-RoPE table)."""
        return self.rope_global.for_batch(batch, self.cfg.mrope_section)

    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> tuple[torch.Tensor, dict]:
        eps, hidden = self.cfg.rms_eps, {}
        if kv.states is None:
            raise RuntimeError("a hybrid model's forward needs recurrent-state storage (KVCache.states)")
        stack = self.fused_stack(batch, kv)
        if stack is not None:
            return x, stack.run(x, batch, kv)  # x updated in place
        seqs = SeqState.of(batch)
        for i, layer in enumerate(self.layers):
            x = x + layer.mixer(self, i, rms_norm(x, layer.attn_norm, eps), batch, kv, seqs)  # summed over ranks
            x = x + layer.mlp(rms_norm(x, layer.ffn_norm, eps))
            if i in batch.hidden_layers:
                hidden[i] = x
        return x, hidden
