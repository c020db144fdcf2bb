"""Gemma 3: sliding-window layers with their own rope base, sandwich norms, gelu(tanh),
embeddings scaled by sqrt(hidden), q/k norms, a final logit soft-cap; norms are (1 + w) in
safetensors (llama.cpp's converter folds the 1 into GGUF files)."""

from specserve.models.families.base import ModelFamily, register


def gemma_layers(n: int, pattern: int = 6) -> tuple[bool, ...]:
    """Every pattern-th layer is global, the others slide."""
    return tuple(bool((i + 1) % pattern) for i in range(n))


def _common(kw: dict) -> dict:
    # Gemma 3 replaced Gemma 2's attention soft-capping with q/k norms: transformers' Gemma 3 and
    # llama.cpp's gemma3 graph both ignore an attn_logit_softcapping left in a config (the model
    # was trained without it), so we do too.
    return dict(qk_norm=True, embed_scale=kw["hidden_size"] ** 0.5, activation="gelu_tanh", sandwich_norms=True,
                attn_softcap=0.0)


def _gguf_fields(read, kw: dict) -> dict:
    return {**_common(kw), "sliding_window": int(read("attention.sliding_window") or 4096),
            "layer_is_sliding": gemma_layers(kw["num_layers"]), "rope_theta_local": 10000.0,
            "rope_scaling_factor": float(read("rope.scaling.factor") or 1.0), "attn_scale": 256 ** -0.5,
            "final_softcap": float(read("final_logit_softcapping") or 0.0)}


def _hf_fields(read, kw: dict) -> dict:
    rope = read("rope_parameters") or {}
    types = read("layer_types")
    sliding = (tuple(t == "sliding_attention" for t in types) if types
               else gemma_layers(kw["num_layers"], read("sliding_window_pattern") or 6))
    local = read("rope_local_base_freq") or rope.get("sliding_attention", {}).get("rope_theta", 10000.0)
    scaling = read("rope_scaling") or rope.get("full_attention") or {}
    factor = float(scaling.get("factor", 1.0)) if scaling.get("rope_type", "default") == "linear" else 1.0
    tie = read("tie_word_embeddings")
    return {**_common(kw), "sliding_window": read("sliding_window") or 4096, "layer_is_sliding": sliding,
            "rope_theta_local": float(local), "rope_scaling_factor": factor,
            "attn_scale": (read("query_pre_attn_scalar") or 256) ** -0.5,
            "final_softcap": float(read("final_logit_softcapping") or 0.0),
            "tie_embeddings": True if tie is None else bool(tie)}


GEMMA3 = register(ModelFamily(
    "gemma3", ("gemma3", "gemma3_text"), gguf_fields=_gguf_fields, hf_fields=_hf_fields,
    hf_layer_names={"post_attention_layernorm": "post_attn_norm"}, hf_norm_offset=1.0,
    hf_rope_kinds=(), hf_default_rope_theta=1e6))
