"""Qwen3: per-head q/k RMSNorm, no q/k/v biases."""

from specserve.models.families.base import ModelFamily, register
from specserve.models.families.qwen2 import qwen_sliding


def _hf_fields(read, kw: dict) -> dict:
    return {**qwen_sliding(read, kw), "qk_norm": True, "qkv_bias": bool(read("attention_bias"))}


QWEN3 = register(ModelFamily("qwen3", ("qwen3",), gguf_fields=lambda read, kw: dict(qk_norm=True),
                             hf_fields=_hf_fields))
