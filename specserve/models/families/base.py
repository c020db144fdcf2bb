"""What a model family declares: its names in each checkpoint format and how its config reads.

A family module (``llama.py``, ``qwen2.py``, ...) builds one :class:`ModelFamily` and registers
it; the config reader, the tensor readers and the loader are generic and ask the registry. The
common checkpoint names (``*_LAYER``, ``*_TOP``) map every format to one internal scheme
(``layers.{i}.q``, ``embed``, ...); a family adds or overrides names of its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

GGUF_LAYER = MappingProxyType({
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "post_attention_norm": "post_attn_norm",
    "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "post_ffw_norm": "post_ffn_norm",
})
GGUF_TOP = MappingProxyType({"token_embd": "embed", "output_norm": "norm", "output": "lm_head"})
HF_LAYER = MappingProxyType({
    "input_layernorm": "attn_norm", "self_attn.q_proj": "q", "self_attn.k_proj": "k",
    "self_attn.v_proj": "v", "self_attn.o_proj": "o", "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm", "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffn_norm",
})
HF_TOP = MappingProxyType({"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"})

ConfigHook = Callable[[Callable, dict], dict]  # (read a key, the common fields) -> fields to add


def _no_fields(read: Callable, kw: dict) -> dict:
    return {}


@dataclass(frozen=True)
class ModelFamily:
    """One architecture: ``arch`` is our name and llama.cpp's GGUF ``general.architecture``."""

    arch: str
    hf_model_types: tuple[str, ...]  # config.json model_type values of this family
    gguf_fields: ConfigHook = _no_fields  # read(key) gets "{arch}.{key}" from the GGUF metadata
    hf_fields: ConfigHook = _no_fields  # read(key) gets a config.json key
    hf_layer_names: Mapping[str, str] = field(default_factory=dict)  # added to / overriding HF_LAYER
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)  # added to / overriding GGUF_LAYER
    gguf_permute_qk: bool = False  # llama.cpp's converter permutes llama's q/k rows for its rope
    hf_norm_offset: float = 0.0  # Gemma's norms are (1 + w) in safetensors; GGUF files folded the 1 in
    hf_norm_offset_skip: tuple[str, ...] = ()  # norms (name suffixes) that are plain w all the same
    hf_rope_kinds: tuple[str | None, ...] = (None, "default", "linear")  # () = any (the family reads its own)
    hf_default_rope_theta: float = 10000.0
    # rewrites a checkpoint's tensors (our names, GGUF or safetensors) into the layout the model
    # code reads (Qwen3-Next's interleaved projections, GGUF's merged experts); None: as read
    rewrite: Callable[[dict, object], dict] | None = None

    def hf_layer_name(self, part: str) -> str | None:
        return self.hf_layer_names.get(part) or HF_LAYER.get(part)

    def gguf_layer_name(self, part: str) -> str | None:
        return self.gguf_layer_names.get(part) or GGUF_LAYER.get(part)


_REGISTRY: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    if family.arch in _REGISTRY:
        raise ValueError(f"model family {family.arch!r} registered twice")
    _REGISTRY[family.arch] = family
    return family


def families() -> dict[str, ModelFamily]:
    return dict(_REGISTRY)
