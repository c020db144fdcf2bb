"""A drafter's decoder layers at inference: the target family's own layer modules.

Training needs a differentiable, batched layer (speculative/layers.py's ``TrainableLayer``). At
inference a trained or shipped head's weights become the family's modules instead —
models/transformer.py's ``DecoderLayer`` (dense attention and MLP) or models/hybrid.py's
``HybridLayer`` (Qwen3.5 / Qwen3-Next gated attention, dense or mixture-of-experts MLP) — under
the family's tensor names, with its ``Linear`` formats (int8 or float32 on CPU), norms and rope
kernels. Only the attention differs from the target's: a drafter attends over rows it keeps
itself (engine/cache/rows.py's ``RowCache``), given to the layer's ``run`` as
:class:`RowAttention` in place of the paged cache. tests/test_family_layer.py checks that the
two forms compute the same function.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import SpecserveError
from specserve.models.config import ModelConfig
from specserve.models.deltanet_config import MoEConfig
from specserve.models.hybrid import HybridLayer
from specserve.models.layers import Linear, Rope
from specserve.models.transformer import DecoderLayer
from specserve.models.weights import RawTensor

ROPE_SLACK = 256  # rope rows past the target's context (a drafter's rows run a block ahead)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What a drafter's layer is (the fields of its config that shape it)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    theta: float
    qk_norm: bool = False
    qkv_bias: bool = False
    output_gate: bool = False  # gated attention (Qwen3.5): a HybridLayer
    rotary_dim: int = 0
    moe: tuple | None = None  # (experts, top k, inter, shared inter, norm top k)
    mrope_section: tuple[int, ...] = ()

    def config(self, target: ModelConfig) -> ModelConfig:
        """The one-layer ModelConfig of this layer: the target's family, the drafter's shapes, and
        what the drafter's training layer does (SwiGLU, 1/sqrt(D), no window, softcap or post-norms)."""
        moe = MoEConfig(*self.moe[:4], norm_topk_prob=bool(self.moe[4])) if self.moe else None
        return dataclasses.replace(
            target, hidden_size=self.hidden, intermediate_size=self.intermediate, num_layers=1,
            num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim, rms_eps=self.eps,
            rope_theta=self.theta, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, sliding_window=0,
            layer_is_sliding=(), rope_theta_local=0.0, rope_scaling_factor=1.0, attn_scale=0.0, attn_softcap=0.0,
            activation="silu", sandwich_norms=False, layer_types=("full_attention",) if self.output_gate else (),
            deltanet=None, rotary_dim=self.rotary_dim, mrope_section=tuple(self.mrope_section),
            attn_output_gate=self.output_gate, mtp_layers=0, moe=moe, extra={})

    def rope(self, target: ModelConfig, device) -> Rope:
        return Rope(self.rotary_dim or self.head_dim, self.theta, target.max_position + ROPE_SLACK, device)


def family_name(name: str) -> str:
    """A drafter layer's parameter name (speculative/layers.py) -> the family's tensor name."""
    name = re.sub(r"^moe\.experts\.(\d+)\.", r"expert\1.", name)
    name = name.replace("moe.shared_gate.", "shexp_gate.").replace("moe.shared.", "shexp.").replace("moe.router.",
                                                                                                     "router.")
    if name.endswith(".weight"):
        name = name.removesuffix(".weight")
    elif name.endswith(".bias"):
        name = name.removesuffix(".bias") + "_bias"
    return f"layers.0.{name}"


def raw(name: str, t: torch.Tensor) -> RawTensor:
    return RawTensor(name, tuple(t.shape), "torch", t.detach().float().cpu())


def family_layer(shape: LayerShape, target: ModelConfig, params: dict[str, torch.Tensor], quant: str, device,
                 rope: Rope) -> DecoderLayer | HybridLayer:
    """The family module of one drafter layer whose parameters (named as speculative/layers.py's
    ``TrainableLayer``) are ``params``; quant "int8" or "none" (float32) on CPU."""
    cfg = shape.config(target)
    w = {family_name(k): raw(k, v) for k, v in params.items()}
    if shape.output_gate:
        return HybridLayer(cfg, 0, w, quant, device, torch.float32)
    layer = DecoderLayer(cfg, 0, w, quant, device, torch.float32, rope)
    layer.unfuse_qkv()  # drafters compute keys and values without queries (context rows)
    return layer


def linear(t: torch.Tensor, quant: str, device) -> Linear:
    """A drafter's own projection (dflash's fc, MTP's eh_proj) as the family's Linear."""
    return Linear(raw("proj", t), None, quant, device, torch.float32)


def sub_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def rope_rows(rope: Rope, positions: torch.Tensor, section: tuple[int, ...]) -> tuple[Rope, torch.Tensor]:
    """The table and positions of rows at ``positions`` [T] or, for a prompt with images, [T, 3]
    (t, h, w): an M-RoPE layer gets a per-row table, any other layer the t axis."""
    if positions.dim() == 1:
        return rope, positions
    if not section:
        return rope, positions[:, 0].contiguous()
    return rope.rows(positions, section), torch.arange(positions.shape[0])


class RowAttention:
    """attention(q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D] for a drafter's rows: each row sees
    the kept rows ctx_k / ctx_v [C, Hkv, D] (None: none), then its own block's rows — all of them,
    or (``causal``) those up to itself. The rows' own k, v stay in ``.k`` / ``.v`` (to be kept)."""

    def __init__(self, scale: float, ctx_k: torch.Tensor | None = None, ctx_v: torch.Tensor | None = None,
                 causal: bool = False):
        self.scale, self.ctx_k, self.ctx_v, self.causal = scale, ctx_k, ctx_v, causal
        self.k = self.v = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k, self.v = k, v
        if self.ctx_k is not None and self.ctx_k.shape[0]:
            k, v = torch.cat([self.ctx_k, k]), torch.cat([self.ctx_v, v])
        t_len, c = q.shape[0], k.shape[0] - q.shape[0]
        rep = q.shape[1] // k.shape[1]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T or C + T, D]
        if rep > 1:
            kh, vh = kh.repeat_interleave(rep, dim=0), vh.repeat_interleave(rep, dim=0)
        mask = None
        if self.causal and t_len > 1:
            mask = torch.ones(t_len, c + t_len, dtype=torch.bool, device=q.device).tril(diagonal=c)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1).contiguous()  # [T, Hq, D]


class DrafterLayers(nn.Module):
    """A drafter's stack of family layers with their rope table: ``run`` one layer over rows."""

    def __init__(self, shape: LayerShape, target: ModelConfig, layer_params: list[dict[str, torch.Tensor]],
                 quant: str, device):
        super().__init__()
        self.shape, self.scale = shape, shape.head_dim ** -0.5
        self.rope = shape.rope(target, device)
        self.layers = nn.ModuleList(family_layer(shape, target, p, quant, device, self.rope) for p in layer_params)

    def run(self, i: int, x: torch.Tensor, positions: torch.Tensor, attention: RowAttention) -> torch.Tensor:
        """Layer i over x [T, H] at positions [T] (or [T, 3]) -> [T, H]."""
        rope, pos = rope_rows(self.rope, positions, self.shape.mrope_section)
        return self.layers[i].run(x.float().contiguous(), rope, pos, attention)

    def keys_values(self, i: int, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's rotated keys and values of normed rows h [T, H] (dense layers)."""
        rope, pos = rope_rows(self.rope, positions, self.shape.mrope_section)
        return self.layers[i].keys_values(h.float().contiguous(), rope, pos)

    def attention(self, ctx_k=None, ctx_v=None, causal: bool = False) -> RowAttention:
        return RowAttention(self.scale, ctx_k, ctx_v, causal)


def linear_quant(weights: str, device) -> str:
    """A drafter's weights ("int8" | "float32") -> its Linear quantization: the kernels' int8
    format on CPU, float32 otherwise (a CUDA device takes the weights in float32)."""
    return "int8" if torch.device(device).type == "cpu" and weights == "int8" else "none"


def weight_format(quantization: str | None, method: str) -> str:
    """A dflash / MTP drafter's ``quantization`` -> its weights: "int8" (the default; on CPU the
    kernels' int8 format) or "float32" ("none": as trained or shipped)."""
    if quantization not in (None, "none", "int8"):
        raise SpecserveError(f'speculative config: a {method} drafter runs in "int8" (the CPU default) or '
                             f'"none" (float32), not {quantization!r}')
    return "float32" if quantization == "none" else "int8"
