"""Model families: one module per family, registered by architecture name."""

from __future__ import annotations

import pytest

from specserve.errors import ModelLoadError
from specserve.models.config import SUPPORTED_ARCHS, from_hf_config
from specserve.models.families import families, family, family_for_model_type
from specserve.models.weights import _hf_name

BASE = dict(num_attention_heads=4, hidden_size=64, intermediate_size=128, num_hidden_layers=6, vocab_size=300)


def test_every_family_is_registered_once_under_its_gguf_name():
    assert SUPPORTED_ARCHS == ("llama", "qwen2", "qwen3", "gemma3")
    for arch, fam in families().items():
        assert fam.arch == arch and family(arch) is fam
        for model_type in fam.hf_model_types:
            assert family_for_model_type(model_type) is fam
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba' in GGUF"):
        family("mamba", "GGUF")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba' in config.json"):
        family_for_model_type("mamba")


@pytest.mark.parametrize("model_type, want", [
    ("llama", dict(qkv_bias=False, qk_norm=False, tie_embeddings=False, sliding_window=0)),
    ("mistral", dict(sliding_window=0)),
    ("qwen2", dict(qkv_bias=True, qk_norm=False)),
    ("qwen3", dict(qkv_bias=False, qk_norm=True)),
    ("gemma3_text", dict(qk_norm=True, tie_embeddings=True, sandwich_norms=True, activation="gelu_tanh",
                         sliding_window=4096, rope_theta=1e6)),
])
def test_family_fields_from_config_json(model_type, want):
    cfg = from_hf_config({**BASE, "model_type": model_type})
    assert {k: getattr(cfg, k) for k in want} == want


def test_family_fields_that_depend_on_the_config():
    mistral = from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 64})
    assert mistral.sliding_window == 64 and all(mistral.sliding(i) for i in range(6))
    qwen = from_hf_config({**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32,
                           "max_window_layers": 4, "attention_bias": False})
    assert [qwen.sliding(i) for i in range(6)] == [False] * 4 + [True] * 2 and not qwen.qkv_bias
    gemma = from_hf_config({**BASE, "model_type": "gemma3_text", "sliding_window_pattern": 3})
    assert [gemma.sliding(i) for i in range(6)] == [True, True, False, True, True, False]


def test_checkpoint_names_are_the_familys():
    assert _hf_name("model.layers.3.post_attention_layernorm.weight", family("gemma3")) == "layers.3.post_attn_norm"
    assert _hf_name("model.layers.3.post_attention_layernorm.weight", family("llama")) == "layers.3.ffn_norm"
    assert _hf_name("model.layers.0.self_attn.q_proj.bias", family("qwen2")) == "layers.0.q_bias"
    assert _hf_name("model.language_model.embed_tokens.weight", family("gemma3")) == "embed"
    assert family("llama").gguf_permute_qk and not family("qwen2").gguf_permute_qk
    assert family("gemma3").hf_norm_offset == 1.0 and family("qwen3").hf_norm_offset == 0.0
