"""Qwen3.5-MoE (Qwen3.5-35B-A3B, -122B-A10B, ...): Qwen3.5's layers (families/qwen3_5.py: Gated
DeltaNet with separate q|k|v, z, b and a projections, gated full attention, zero-centred norms)
with Qwen3-Next's mixture-of-experts MLP in every layer (a softmax router whose top k are always
renormalised, a sigmoid-gated shared expert). The model code is models/hybrid.py, as for both."""

from specserve.models.families.base import ModelFamily, register
from specserve.models.families.qwen3_5 import GGUF_HYBRID, HF_LINEAR_ATTN, hybrid_gguf_fields
from specserve.models.families.qwen3_next import GGUF_MOE, HF_MOE, moe_gguf_fields, split_experts
from specserve.models.families.qwen3_next import _hf_fields as moe_hf_fields


def _gguf_fields(read, kw: dict) -> dict:
    return moe_gguf_fields(read, hybrid_gguf_fields(read, kw, tiled=True))  # value heads tiled, as Qwen3.5's


def _rewrite(tensors: dict, cfg) -> dict:
    return split_experts(tensors)


QWEN3_5_MOE = register(ModelFamily(
    "qwen35moe", ("qwen3_5_moe", "qwen3_5_moe_text"), gguf_fields=_gguf_fields, hf_fields=moe_hf_fields,
    hf_layer_names={**HF_LINEAR_ATTN, **HF_MOE}, gguf_layer_names={**GGUF_HYBRID, **GGUF_MOE}, hf_norm_offset=1.0,
    hf_norm_offset_skip=("ssm_norm",), hf_default_rope_theta=1e7, rewrite=_rewrite))
