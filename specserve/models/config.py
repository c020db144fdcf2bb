"""Architecture hyper-parameters, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.errors import ModelLoadError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# HF model_type / architectures -> our arch name
_HF_ARCH = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma3_text": "gemma3", "gemma3": "gemma3",
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about one decoder-only transformer."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0  # 0 = every layer is global
    layer_is_sliding: tuple[bool, ...] = ()  # per layer; empty = none sliding
    rope_theta_local: float = 0.0  # rope base of sliding layers (Gemma 3)
    rope_scaling_factor: float = 1.0  # linear rope scaling on global layers
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden)
    attn_scale: float = 0.0  # 0 = 1/sqrt(head_dim)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    activation: str = "silu"  # "silu" | "gelu_tanh"
    sandwich_norms: bool = False  # Gemma: post-attention and pre/post-feedforward norms
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_is_sliding) and self.layer_is_sliding[layer]

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_theta_local if self.sliding(layer) and self.rope_theta_local else self.rope_theta

    @property
    def num_global_layers(self) -> int:
        """Layers whose KV cache grows with the context."""
        return sum(1 for i in range(self.num_layers) if not self.sliding(i))


def _gemma_layers(n: int, pattern: int = 6) -> tuple[bool, ...]:
    return tuple(bool((i + 1) % pattern) for i in range(n))


def from_gguf_metadata(meta: dict, vocab_size: int) -> ModelConfig:
    """Build a config from GGUF key/values (already decoded to python values)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r} in GGUF (supported: {', '.join(SUPPORTED_ARCHS)})")

    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", 0) or g("rope.dimension_count", 0) or hidden // heads)
    kw = dict(
        arch=arch, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")), num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position=int(g("context_length", 4096)),
    )
    if arch == "qwen2":
        kw.update(qkv_bias=True)
    if arch == "qwen3":
        kw.update(qk_norm=True)
    if arch == "gemma3":
        n = kw["num_layers"]
        kw.update(qk_norm=True, sliding_window=int(g("attention.sliding_window", 4096)),
                  layer_is_sliding=_gemma_layers(n), rope_theta_local=10000.0,
                  rope_scaling_factor=float(g("rope.scaling.factor", 1.0) or 1.0),
                  embed_scale=hidden ** 0.5, attn_scale=256 ** -0.5, activation="gelu_tanh",
                  sandwich_norms=True, final_softcap=float(g("final_logit_softcapping", 0.0) or 0.0),
                  attn_softcap=0.0)  # Gemma 3 has no attention soft-capping: see from_hf_config
    return ModelConfig(**kw)


def from_hf_config(cfg: dict) -> ModelConfig:
    """Build a config from a Hugging Face config.json dict."""
    if "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    arch = _HF_ARCH.get(cfg.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {cfg.get('model_type')!r} in config.json "
                             f"(supported: llama, mistral, qwen2, qwen3, gemma3)")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or rope
    kind = scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None
    if kind not in (None, "default", "linear") and arch != "gemma3":
        raise ModelLoadError(f"unsupported rope scaling {kind!r} in config.json (supported: none, linear)")
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or rope.get("full_attention", {}).get("rope_theta")
    kw = dict(
        arch=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden, intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads, rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta or (1e6 if arch == "gemma3" else 10000.0)),
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=cfg.get("tie_word_embeddings", arch == "gemma3"),
        qkv_bias=cfg.get("attention_bias", arch == "qwen2"), qk_norm=arch in ("qwen3", "gemma3"),
    )
    if arch == "llama" and cfg.get("sliding_window"):
        kw.update(sliding_window=cfg["sliding_window"], layer_is_sliding=(True,) * cfg["num_hidden_layers"])
    if arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        # as transformers does: layer_types if given, else layers from max_window_layers on slide
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        sliding = (tuple(t == "sliding_attention" for t in types) if types
                   else tuple(i >= cfg.get("max_window_layers", n) for i in range(n)))
        if any(sliding):
            kw.update(sliding_window=cfg["sliding_window"], layer_is_sliding=sliding)
    if arch == "gemma3":
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        sliding = tuple(t == "sliding_attention" for t in types) if types else _gemma_layers(
            n, cfg.get("sliding_window_pattern", 6))
        local = cfg.get("rope_local_base_freq") or rope.get("sliding_attention", {}).get("rope_theta", 10000.0)
        scaling = (cfg.get("rope_scaling") or rope.get("full_attention") or {})
        factor = float(scaling.get("factor", 1.0)) if scaling.get("rope_type", "default") == "linear" else 1.0
        kw.update(sliding_window=cfg.get("sliding_window", 4096), layer_is_sliding=sliding,
                  rope_theta_local=float(local), rope_scaling_factor=factor, embed_scale=hidden ** 0.5,
                  attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5, activation="gelu_tanh",
                  sandwich_norms=True, final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
                  # Gemma 3 replaced Gemma 2's attention soft-capping with q/k norms: transformers'
                  # Gemma 3 and llama.cpp's gemma3 graph both ignore an attn_logit_softcapping left
                  # in a config (the model was trained without it), so we do too.
                  attn_softcap=0.0)
    return ModelConfig(**kw)
