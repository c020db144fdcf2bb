"""Qwen3-Next: the hybrid of Qwen3.5 (Gated DeltaNet + gated attention, zero-centred norms) with
mixture-of-experts MLPs (a router, top-k experts, a gated shared expert) and the DeltaNet's input
projections fused and interleaved per key head (in_proj_qkvz, in_proj_ba), which ``_rewrite``
turns into the q|k|v, z, b and a projections the model code reads."""

import torch

from specserve.models.deltanet_config import MoEConfig
from specserve.models.families.base import ModelFamily, register
from specserve.models.families.qwen3_5 import HF_LINEAR_ATTN
from specserve.models.families.qwen3_5 import _hf_fields as hybrid_fields

HF_NAMES = {
    **{k: v for k, v in HF_LINEAR_ATTN.items() if not k.startswith("linear_attn.in_proj_")},
    "linear_attn.in_proj_qkvz": "ssm_in_qkvz", "linear_attn.in_proj_ba": "ssm_in_ba",
    "mlp.gate": "router", "mlp.shared_expert.gate_proj": "shexp.gate", "mlp.shared_expert.up_proj": "shexp.up",
    "mlp.shared_expert.down_proj": "shexp.down", "mlp.shared_expert_gate": "shexp_gate",
}


def _hf_fields(read, kw: dict) -> dict:
    out = hybrid_fields(read, kw)
    if int(read("num_experts") or 0) > 0:
        out["moe"] = MoEConfig(int(read("num_experts")), int(read("num_experts_per_tok")),
                               int(read("moe_intermediate_size")), int(read("shared_expert_intermediate_size") or 0),
                               bool(read("norm_topk_prob") if read("norm_topk_prob") is not None else True),
                               int(read("decoder_sparse_step") or 1), tuple(read("mlp_only_layers") or ()))
    return out


def _rewrite(tensors: dict, cfg) -> dict:
    """[q, k, v, z] and [b, a] interleaved per key head -> q|k|v (all heads of each), z, b, a."""
    from specserve.models.weights import RawTensor

    dn, out = cfg.deltanet, dict(tensors)
    hk, r = dn.num_k_heads, dn.num_v_heads // dn.num_k_heads
    for i in cfg.linear_layers:
        qkvz, ba = out.pop(f"layers.{i}.ssm_in_qkvz", None), out.pop(f"layers.{i}.ssm_in_ba", None)
        if qkvz is None or ba is None:
            continue  # reported as missing tensors by the model
        w = qkvz.dequantize().view(hk, -1, cfg.hidden_size)
        q, k, v, z = w.split((dn.k_head_dim, dn.k_head_dim, r * dn.v_head_dim, r * dn.v_head_dim), dim=1)
        b, a = ba.dequantize().view(hk, 2 * r, cfg.hidden_size).split((r, r), dim=1)
        for name, t in (("attn_qkv", torch.cat([x.reshape(-1, cfg.hidden_size) for x in (q, k, v)])),
                        ("attn_gate", z), ("ssm_beta", b), ("ssm_alpha", a)):
            t = t.reshape(-1, cfg.hidden_size).contiguous()
            out[f"layers.{i}.{name}"] = RawTensor(f"layers.{i}.{name}", tuple(t.shape), "torch", t)
    return out


QWEN3_NEXT = register(ModelFamily(
    "qwen3next", ("qwen3_next",), hf_fields=_hf_fields, hf_layer_names=HF_NAMES, hf_norm_offset=1.0,
    hf_norm_offset_skip=("ssm_norm",), hf_default_rope_theta=1e7, hf_rewrite=_rewrite))
