"""Model families: one module per family, registered by architecture name."""

from __future__ import annotations

import pytest

from specserve.errors import ModelLoadError
from specserve.models.config import SUPPORTED_ARCHS, from_hf_config
from specserve.models.families import families, family, family_for_model_type
from specserve.models.weights import _hf_name

BASE = dict(num_attention_heads=4, hidden_size=64, intermediate_size=128, num_hidden_layers=6, vocab_size=300)


def test_every_family_is_registered_once_under_its_gguf_name():
    assert SUPPORTED_ARCHS == ("llama", "qwen2", "qwen3", "gemma3", "qwen35", "qwen3next", "qwen35moe")
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


def test_hybrid_fields_from_config_json():
    """Qwen3.5: layer types from full_attention_interval when layer_types is absent, the text part
    of a multimodal config with tie_word_embeddings kept at its top level."""
    text = {**BASE, "model_type": "qwen3_5_text", "head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
            "full_attention_interval": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}}
    cfg = from_hf_config({"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text})
    assert cfg.arch == "qwen35" and cfg.tie_embeddings and cfg.rope_theta == 1e7
    assert cfg.linear_layers == (0, 1, 3, 4) and cfg.attention_layers == (2, 5)
    assert cfg.rotary_dim == 4  # partial_rotary_factor defaults to 0.25
    with pytest.raises(ModelLoadError, match="linear_value_head_dim"):
        from_hf_config({k: v for k, v in text.items() if k != "linear_value_head_dim"})
    assert _hf_name("model.language_model.layers.3.linear_attn.A_log", family("qwen35")) == "layers.3.ssm_a_log"
    assert _hf_name("mtp.layers.0.mlp.up_proj.weight", family("qwen35")) is None


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
