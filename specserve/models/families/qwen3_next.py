"""Qwen3-Next: the hybrid of Qwen3.5 (Gated DeltaNet + gated attention, zero-centred norms) with
mixture-of-experts MLPs (a router, top-k experts, a gated shared expert) and the DeltaNet's input
projections fused and interleaved per key head (in_proj_qkvz, in_proj_ba), which ``_rewrite``
turns into the q|k|v, z, b and a projections the model code reads."""

import torch

from specserve.models.deltanet_config import MoEConfig
from specserve.models.families.base import ModelFamily, register
from specserve.models.families.qwen3_5 import GGUF_HYBRID, HF_LINEAR_ATTN, hybrid_gguf_fields
from specserve.models.families.qwen3_5 import _hf_fields as hybrid_fields

# the mixture-of-experts MLP's names (Qwen3.5-MoE's too: families/qwen3_5_moe.py)
HF_MOE = {"mlp.gate": "router", "mlp.shared_expert.gate_proj": "shexp.gate", "mlp.shared_expert.up_proj": "shexp.up",
          "mlp.shared_expert.down_proj": "shexp.down", "mlp.shared_expert_gate": "shexp_gate"}
HF_NAMES = {
    **{k: v for k, v in HF_LINEAR_ATTN.items() if not k.startswith("linear_attn.in_proj_")},
    "linear_attn.in_proj_qkvz": "ssm_in_qkvz", "linear_attn.in_proj_ba": "ssm_in_ba", **HF_MOE,
}


def _hf_fields(read, kw: dict) -> dict:
    """The hybrid's fields and, with num_experts, the MoEConfig (norm_topk_prob absent: normalised,
    as Qwen3.5-MoE's router always does; decoder_sparse_step / mlp_only_layers absent: every layer)."""
    out = hybrid_fields(read, kw)
    if int(read("num_experts") or 0) > 0:
        norm = read("norm_topk_prob")
        out["moe"] = MoEConfig(int(read("num_experts")), int(read("num_experts_per_tok")),
                               int(read("moe_intermediate_size")), int(read("shared_expert_intermediate_size") or 0),
                               bool(norm if norm is not None else True),
                               int(read("decoder_sparse_step") or 1), tuple(read("mlp_only_layers") or ()))
    return out


def _rewrite(tensors: dict, cfg) -> dict:
    """[q, k, v, z] and [b, a] interleaved per key head -> q|k|v (all heads of each), z, b, a;
    GGUF's experts (3-D, all experts in one tensor) -> one tensor per expert."""
    from specserve.models.weights import RawTensor

    dn, out, hidden = cfg.deltanet, dict(tensors), cfg.hidden_size
    hk, r = dn.num_k_heads, dn.num_v_heads // dn.num_k_heads

    def put(name: str, t: torch.Tensor) -> None:
        t = t.reshape(-1, hidden).contiguous()
        out[name] = RawTensor(name, tuple(t.shape), "torch", t)

    for i in cfg.linear_layers:
        qkvz, ba = out.pop(f"layers.{i}.ssm_in_qkvz", None), out.pop(f"layers.{i}.ssm_in_ba", None)
        if qkvz is not None:  # (llama.cpp's converter splits it into attn_qkv and attn_gate itself)
            w = qkvz.dequantize().view(hk, -1, hidden)
            q, k, v, z = w.split((dn.k_head_dim, dn.k_head_dim, r * dn.v_head_dim, r * dn.v_head_dim), dim=1)
            put(f"layers.{i}.attn_qkv", torch.cat([x.reshape(-1, hidden) for x in (q, k, v)]))
            put(f"layers.{i}.attn_gate", z)
        if ba is not None:
            b, a = ba.dequantize().view(hk, 2 * r, hidden).split((r, r), dim=1)
            put(f"layers.{i}.ssm_beta", b)
            put(f"layers.{i}.ssm_alpha", a)
    return split_experts(out)


def split_experts(tensors: dict) -> dict:
    """GGUF's experts (3-D, all experts in one tensor) -> one tensor per expert."""
    from specserve.models.weights import RawTensor

    out = dict(tensors)
    for name in [n for n in out if ".experts." in n]:
        raw = out.pop(name)
        layer, part = name.split(".experts.")
        for e in range(raw.shape[0]):
            data = raw.data[e]  # (only GGUF names experts this way: safetensors' are split at read)
            out[f"{layer}.expert{e}.{part}"] = RawTensor(f"{layer}.expert{e}.{part}", tuple(raw.shape[1:]), raw.qtype,
                                                         data)
    return out


GGUF_MOE = {"ffn_gate_inp": "router", "ffn_gate_shexp": "shexp.gate", "ffn_up_shexp": "shexp.up",
            "ffn_down_shexp": "shexp.down", "ffn_gate_inp_shexp": "shexp_gate",
            "ffn_gate_exps": "experts.gate", "ffn_up_exps": "experts.up", "ffn_down_exps": "experts.down"}
GGUF_NAMES = {**GGUF_HYBRID, "ssm_ba": "ssm_in_ba", **GGUF_MOE}


def _gguf_fields(read, kw: dict) -> dict:
    return moe_gguf_fields(read, hybrid_gguf_fields(read, kw, tiled=False))  # Qwen3-Next's: grouped order


def moe_gguf_fields(read, out: dict) -> dict:
    """``out`` with the MoEConfig of llama.cpp's expert_* keys, where there are experts."""
    if int(read("expert_count") or 0) > 0:
        norm = read("expert_weights_norm")
        out["moe"] = MoEConfig(int(read("expert_count")), int(read("expert_used_count")),
                               int(read("expert_feed_forward_length")),
                               int(read("expert_shared_feed_forward_length") or 0),
                               True if norm is None else bool(norm))
    return out


QWEN3_NEXT = register(ModelFamily(
    "qwen3next", ("qwen3_next",), gguf_fields=_gguf_fields, hf_fields=_hf_fields, hf_layer_names=HF_NAMES,
    gguf_layer_names=GGUF_NAMES, hf_norm_offset=1.0, hf_norm_offset_skip=("ssm_norm",), hf_default_rope_theta=1e7,
    rewrite=_rewrite))
