"""Building blocks the drafters share (dflash, the MTP head) for training: RMSNorm, rope and a
decoder layer in differentiable, batched torch; the target's LM head; the identity checks of a
drafter against its target. At inference a drafter's layers are the target family's own modules
(speculative/family_layer.py), built from a ``TrainableLayer``'s weights under the family's names;
tests/test_family_layer.py checks that both compute the same function."""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import SpecserveError
from specserve.models.layers import route_top_k
from specserve.models.loader import LoadedModel



# ---- building blocks shared with the MTP head -------------------------------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Differentiable RMS norm in float32 (x: [..., H])."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_tables(head_dim: int, theta: float, positions: torch.Tensor,
                mrope_section: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [...] -> cos, sin [..., D/2]; with mrope_section, positions [..., 3] (t, h, w)
    and each frequency at its axis's position (interleaved M-RoPE, as the target's Rope.rows)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[..., None] * inv.to(positions.device)  # [..., D/2] or [..., 3, D/2]
    if mrope_section:
        i = torch.arange(inv.numel(), device=positions.device)
        axis = torch.where((i % 3 == 1) & (i < 3 * mrope_section[1]), 1,
                           torch.where((i % 3 == 2) & (i < 3 * mrope_section[2]), 2, 0))  # [D/2]
        freqs = freqs.gather(-2, axis.expand(*freqs.shape[:-2], 1, -1)).squeeze(-2)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, D]; cos/sin: [..., T, D/2] (half-split layout, as the target)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(h)) * self.up(h))


class MoEMLP(nn.Module):
    """A mixture-of-experts MLP (Qwen3-Next's): softmax router, the top k experts per token
    (renormalised with norm_topk), a shared expert behind a sigmoid gate."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int, norm_topk: bool):
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(num_experts))
        self.shared = SwiGLU(hidden, shared_inter) if shared_inter else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_inter else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., H]
        flat = h.reshape(-1, h.shape[-1])
        weight, groups = route_top_k(self.router(flat).float(), self.top_k, self.norm_topk)
        out = torch.zeros_like(flat)
        for e, rows, slot in groups:
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weight[rows, slot, None].to(flat.dtype))
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return out.view_as(h)


class TrainableLayer(nn.Module):
    """A drafter's layer in training: pre-norm attention + SwiGLU MLP; attention over (extra
    keys/values ++ own rows) with a mask, batched [b, T, H].

    output_gate (Qwen3.5's gated attention): the q projection gives each head its query then a
    gate, and the attention output is multiplied by sigmoid(gate); rotary_dim: rope on the first
    rotary_dim dims of each head only (0 = all); moe: a mixture-of-experts MLP instead of SwiGLU."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 theta: float, qk_norm: bool = False, qkv_bias: bool = False, output_gate: bool = False,
                 rotary_dim: int = 0, moe: tuple | None = None, mrope_section: tuple[int, ...] = ()):
        super().__init__()
        self.mrope_section = tuple(mrope_section)  # M-RoPE: positions come as [..., T, 3]
        self.heads, self.kv_heads, self.head_dim, self.eps, self.theta = heads, kv_heads, head_dim, eps, theta
        self.output_gate, self.rotary_dim = output_gate, rotary_dim or head_dim
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.q = nn.Linear(hidden, heads * head_dim * (2 if output_gate else 1), bias=qkv_bias)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = nn.Parameter(torch.ones(head_dim))
            self.k_norm = nn.Parameter(torch.ones(head_dim))
        self.ffn_norm = nn.Parameter(torch.ones(hidden))
        self.moe = MoEMLP(hidden, *moe) if moe else None  # (experts, top k, inter, shared inter, norm top k)
        if self.moe is None:
            self.gate = nn.Linear(hidden, inter, bias=False)
            self.up = nn.Linear(hidden, inter, bias=False)
            self.down = nn.Linear(inter, hidden, bias=False)

    def kv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [..., T, H] (already normed) -> rotated k, v: [..., T, kv_heads, D]."""
        k = self.k(h).unflatten(-1, (self.kv_heads, self.head_dim))
        v = self.v(h).unflatten(-1, (self.kv_heads, self.head_dim))
        if self.qk_norm:
            k = rms(k, self.k_norm, self.eps)
        return self.rotate(k, positions), v

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        mrope = self.mrope_section if positions.dim() == x.dim() - 1 else ()  # [..., T, 3]: M-RoPE
        if positions.dim() == x.dim() - 1 and not mrope:
            positions = positions[..., 0]  # (a layer without M-RoPE: the t axis)
        cos, sin = rope_tables(rd, self.theta, positions, mrope)
        if rd == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, extra_k: torch.Tensor | None,
                extra_v: torch.Tensor | None, mask: torch.Tensor | None, return_kv: bool = False):
        """x: [b, T, H]; positions: [b, T]; extra_k/v: [b, C, kvh, D] or None;
        mask: [b, T, C + T] bool (True = may attend) or None (everything).
        Returns x [b, T, H], plus the rows' own (k, v) with return_kv."""
        h = rms(x, self.attn_norm, self.eps)
        q = self.q(h).unflatten(-1, (self.heads, -1))  # [b, T, heads, D or 2D]
        q, gate = (q[..., :self.head_dim], q[..., self.head_dim:]) if self.output_gate else (q, None)
        if self.qk_norm:
            q = rms(q, self.q_norm, self.eps)
        q = self.rotate(q, positions)
        k, v = self.kv(h, positions)
        own = (k, v)
        if extra_k is not None:
            k, v = torch.cat([extra_k, k], dim=1), torch.cat([extra_v, v], dim=1)
        rep = self.heads // self.kv_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, T, D]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
        attn = attn.transpose(1, 2)  # [b, T, heads, D]
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        x = x + self.o(attn.flatten(-2))
        h = rms(x, self.ffn_norm, self.eps)
        x = x + (self.moe(h) if self.moe is not None else self.down(F.silu(self.gate(h)) * self.up(h)))
        return (x, own) if return_kv else x


def spread_layers(num_layers: int, k: int) -> tuple[int, ...]:
    """k target layers spread from early to late (e.g. 30 layers, k=3 -> (1, 15, 28))."""
    if k <= 1:
        return (num_layers - 2 if num_layers > 2 else num_layers - 1,)
    first, last = (1, num_layers - 2) if num_layers > 4 else (0, num_layers - 1)
    return tuple(sorted({round(first + i * (last - first) / (k - 1)) for i in range(k)}))


def vocab_hash(target: LoadedModel) -> str:
    tok = target.tokenizer
    return hashlib.sha256("\x00".join(tok.vocab_fingerprint()).encode()).hexdigest()[:16]


def target_identity(target: LoadedModel) -> dict:
    c = target.config
    return {"name": target.name, "arch": c.arch, "hidden_size": c.hidden_size, "num_layers": c.num_layers,
            "vocab_size": c.vocab_size, "vocab_hash": vocab_hash(target)}


def check_target(cfg_target: dict, target: LoadedModel, where: str) -> None:
    """A trained drafter only makes sense on the target it was trained for."""
    have = target_identity(target)
    for key in ("hidden_size", "num_layers", "vocab_size"):
        if key in cfg_target and cfg_target[key] != have[key]:
            raise SpecserveError(f"drafter {where} was trained for {cfg_target.get('name')!r} ({key} "
                                 f"{cfg_target[key]}), but the target {target.name!r} has {key} {have[key]}")
    if cfg_target.get("vocab_hash") and cfg_target["vocab_hash"] != have["vocab_hash"]:
        raise SpecserveError(f"drafter {where} was trained for {cfg_target.get('name')!r}, whose vocabulary "
                             f"differs from that of {target.name!r}")


class TargetHead:
    """The frozen target pieces a drafter uses: embedding, final norm weight, LM head.

    At inference the drafter calls the target's own ``embed``/``logits`` (its kernels); for
    training, ``float_head()`` gives a differentiable float copy of the LM head weight.
    """

    def __init__(self, target: LoadedModel):
        self.model = target.model
        self.cfg = target.config

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids).float()

    def logits(self, h: torch.Tensor, vocab=None) -> torch.Tensor:
        """h [L, H] after the final norm -> [L, V]; with a DraftVocab, -inf outside its set."""
        h = h.to(self.model.dtype).contiguous()
        return self.model.logits(h) if vocab is None else vocab.logits(h)

    def float_head(self) -> torch.Tensor:
        return self.model.lm_head.float_weight()


def head_logits(h: torch.Tensor, head_w: torch.Tensor, softcap: float) -> torch.Tensor:
    """Differentiable LM head (training): h [.., H] normed -> [.., V]."""
    out = F.linear(h, head_w)
    return torch.tanh(out / softcap) * softcap if softcap else out
