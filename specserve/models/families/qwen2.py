"""Qwen2 / Qwen2.5: biases on q/k/v; optional sliding window on the upper layers."""

from specserve.models.families.base import ModelFamily, register


def qwen_sliding(read, kw: dict) -> dict:
    """As transformers does: layer_types if given, else layers from max_window_layers on slide."""
    if not (read("use_sliding_window") and read("sliding_window")):
        return {}
    n = kw["num_layers"]
    types = read("layer_types")
    sliding = (tuple(t == "sliding_attention" for t in types) if types
               else tuple(i >= (read("max_window_layers") or n) for i in range(n)))
    return dict(sliding_window=read("sliding_window"), layer_is_sliding=sliding) if any(sliding) else {}


def _hf_fields(read, kw: dict) -> dict:
    bias = read("attention_bias")
    return {**qwen_sliding(read, kw), "qkv_bias": True if bias is None else bool(bias)}


QWEN2 = register(ModelFamily("qwen2", ("qwen2",), gguf_fields=lambda read, kw: dict(qkv_bias=True),
                             hf_fields=_hf_fields))
