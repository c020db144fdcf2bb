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
    # M-RoPE positions matter for images only; the interleaved layout is the one implemented
    mrope = tuple(int(x) for x in rope.get("mrope_section") or ()) if rope.get("mrope_interleaved", True) else ()
    return dict(mrope_section=mrope,
                layer_types=hybrid_layer_types(kw["num_layers"], read("layer_types"), read("full_attention_interval")),
                deltanet=deltanet, rotary_dim=int(kw["head_dim"] * float(partial)), attn_output_gate=True,
                qk_norm=True, tie_embeddings=bool(tie), mtp_layers=int(read("mtp_num_hidden_layers") or 0))


# llama.cpp's names (its converter folded the norms' 1 in, stores -exp(A_log) as ssm_a, and puts
# the value heads in tiled order); post_attention_norm is the pre-MLP norm in this architecture
GGUF_HYBRID = {n: n for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_conv1d", "ssm_a", "ssm_dt",
                              "ssm_norm", "ssm_out")}
GGUF_HYBRID["post_attention_norm"] = "ffn_norm"


def _gguf_fields(read, kw: dict) -> dict:
    return hybrid_gguf_fields(read, kw, tiled=True)


def hybrid_gguf_fields(read, kw: dict, tiled: bool) -> dict:
    """tiled: the converter put the value heads in llama.cpp's tiled order (Qwen3.5's does, when
    there are more value heads than key heads; Qwen3-Next's does not)."""
    nextn = int(read("nextn_predict_layers") or 0)  # MTP layers, counted in block_count
    n = kw["num_layers"] - nextn
    need = ("ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size", "ssm.conv_kernel")
    missing = [k for k in need if read(k) is None]
    if missing:
        raise ModelLoadError(f"GGUF of a hybrid model lacks {', '.join(missing)}")
    hk, hv, dk, inner, kernel = (int(read(k)) for k in need)
    recurrent = read("attention.recurrent_layers")
    types = (tuple("linear_attention" if r else "full_attention" for r in list(recurrent)[:n]) if recurrent
             else hybrid_layer_types(n, None, read("full_attention_interval")))
    sections = tuple(int(x) for x in list(read("rope.dimension_sections") or ())[:3])
    return dict(mrope_section=sections if any(sections) else (), num_layers=n, layer_types=types, qk_norm=True,
                attn_output_gate=True,
                deltanet=DeltaNetConfig(hk, hv, dk, inner // hv, kernel, v_tiled=tiled and hk != hv),
                rotary_dim=int(read("rope.dimension_count") or kw["head_dim"] // 4), mtp_layers=nextn)


QWEN3_5 = register(ModelFamily(
    "qwen35", ("qwen3_5", "qwen3_5_text"), gguf_fields=_gguf_fields, hf_fields=_hf_fields,
    hf_layer_names=HF_LINEAR_ATTN, gguf_layer_names=GGUF_HYBRID, hf_norm_offset=1.0,
    hf_norm_offset_skip=("ssm_norm",), hf_default_rope_theta=1e7))
