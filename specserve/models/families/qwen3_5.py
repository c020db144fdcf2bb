"""Qwen3.5 (and Qwen3.6 / Qwen3.8): a hybrid of Gated DeltaNet layers (linear attention with a
fixed-size recurrent state) and gated full-attention layers (a sigmoid gate on the attention
output, q/k norms, partial rotary). Norms are zero-centred, (1 + w), except the DeltaNet's gated
output norm; the layer types come from the config (``layer_types`` or
``full_attention_interval``), never from a model name. The model code is models/hybrid.py."""

from specserve.errors import ModelLoadError
from specserve.models.deltanet_config import DeltaNetConfig
from specserve.models.families.base import ModelFamily, register

HF_LINEAR_ATTN = {
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d", "linear_attn.A_log": "ssm_a_log", "linear_attn.dt_bias": "ssm_dt",
    "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
}


def hybrid_layer_types(n: int, types, interval) -> tuple[str, ...]:
    """transformers' rule: layer_types if given, else every interval-th layer is full attention."""
    if types:
        return tuple(types)
    interval = int(interval or 4)
    if interval < 1:
        raise ModelLoadError(f"full_attention_interval must be >= 1, got {interval}")
    return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(n))


def _hf_fields(read, kw: dict) -> dict:
    rope = read("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", read("partial_rotary_factor") or 0.25)
    need = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    missing = [k for k in need if read(k) is None]
    if missing:
        raise ModelLoadError(f"config.json of a hybrid model lacks {', '.join(missing)}")
    deltanet = DeltaNetConfig(*(int(read(k)) for k in need), conv_kernel=int(read("linear_conv_kernel_dim") or 4))
    tie = read("tie_word_embeddings")
    return dict(layer_types=hybrid_layer_types(kw["num_layers"], read("layer_types"), read("full_attention_interval")),
                deltanet=deltanet, rotary_dim=int(kw["head_dim"] * float(partial)), attn_output_gate=True,
                qk_norm=True, tie_embeddings=bool(tie))


QWEN3_5 = register(ModelFamily(
    "qwen35", ("qwen3_5", "qwen3_5_text"), hf_fields=_hf_fields, hf_layer_names=HF_LINEAR_ATTN,
    hf_norm_offset=1.0, hf_norm_offset_skip=("ssm_norm",), hf_default_rope_theta=1e7))
