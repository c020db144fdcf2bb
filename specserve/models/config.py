"""Architecture hyper-parameters, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.errors import ModelLoadError
from specserve.models.deltanet_config import DeltaNetConfig, MoEConfig
from specserve.models.families import families, family, family_for_model_type

SUPPORTED_ARCHS = tuple(families())
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


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
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES; empty: none is linear attention
    deltanet: DeltaNetConfig | None = None  # the linear-attention layers' shapes (hybrid models)
    rotary_dim: int = 0  # rotated dims of a head (partial rotary); 0 = head_dim
    # M-RoPE (Qwen3.5 / Qwen3-VL): rotary frequencies per axis (t, h, w), interleaved t,h,w,t,h,w...
    mrope_section: tuple[int, ...] = ()
    attn_output_gate: bool = False  # q projection twice as wide: a sigmoid gate on the attention output
    mtp_layers: int = 0  # multi-token-prediction layers shipped in the checkpoint (mtp.*, GGUF nextn)
    moe: MoEConfig | None = None  # sparse MLPs (Qwen3-Next); None: every MLP is dense
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_types:
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ModelLoadError(f"unsupported layer type {unknown[0]!r} in the config "
                                     f"(supported: {', '.join(LAYER_TYPES)})")
            if len(self.layer_types) != self.num_layers:
                raise ModelLoadError(f"layer_types lists {len(self.layer_types)} layers, the model has "
                                     f"{self.num_layers}")
            if self.linear_layers and self.deltanet is None:
                raise ModelLoadError("the config has linear_attention layers but no linear-attention shapes")

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

    def is_linear(self, layer: int) -> bool:
        """A Gated DeltaNet layer (a fixed-size recurrent state instead of K/V)."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_linear(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers that keep K/V."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    @property
    def hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def state_bytes(self) -> int:
        """One sequence's recurrent state over all linear-attention layers (float32)."""
        return len(self.linear_layers) * self.deltanet.state_floats * 4 if self.hybrid else 0

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_theta_local if self.sliding(layer) and self.rope_theta_local else self.rope_theta

    @property
    def num_global_layers(self) -> int:
        """Layers whose KV cache grows with the context."""
        return sum(1 for i in self.attention_layers if not self.sliding(i))


def from_gguf_metadata(meta: dict, vocab_size: int) -> ModelConfig:
    """Build a config from GGUF key/values (already decoded to python values): the fields every
    family has, then the family's own (``ModelFamily.gguf_fields``)."""
    arch = meta.get("general.architecture")
    fam = family(arch, "GGUF")

    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", 0) or g("rope.dimension_count", 0) or hidden // heads)
    ffn = g("feed_forward_length") or g("expert_feed_forward_length")  # (every MLP a mixture of experts)
    if ffn is None:
        raise ModelLoadError(f"GGUF lacks {arch}.feed_forward_length")
    kw = dict(
        arch=arch, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=int(ffn),
        num_layers=int(g("block_count")), num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position=int(g("context_length", 4096)),
    )
    kw.update(fam.gguf_fields(g, kw))
    return ModelConfig(**kw)


def from_hf_config(cfg: dict) -> ModelConfig:
    """Build a config from a Hugging Face config.json dict: the fields every family has, then
    the family's own (``ModelFamily.hf_fields``)."""
    if "text_config" in cfg:
        top = {k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}  # kept at the top by multimodal configs
        cfg = {**top, **cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    if "model_type" not in cfg and isinstance(cfg.get("drafter"), str):  # one of our drafters (train-drafter's)
        target = (cfg.get("target") or {}).get("name", "its target")
        raise ModelLoadError(f"this is a {cfg['drafter']} drafter for {target}, not a model: serve {target} with "
                             f"--speculative-config '{{\"method\": \"{cfg['drafter']}\", \"model\": ...}}'")
    fam = family_for_model_type(cfg.get("model_type", ""))
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or rope
    kind = scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None
    if fam.hf_rope_kinds and kind not in fam.hf_rope_kinds:
        raise ModelLoadError(f"unsupported rope scaling {kind!r} in config.json (supported: none, linear)")
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or rope.get("full_attention", {}).get("rope_theta")
    # every MLP a mixture of experts (Qwen3.5-MoE): no dense width, the experts' stands in
    ffn = cfg.get("intermediate_size") or cfg.get("moe_intermediate_size")
    if ffn is None:
        raise ModelLoadError("config.json lacks intermediate_size")
    kw = dict(
        arch=fam.arch, vocab_size=cfg["vocab_size"], hidden_size=hidden, intermediate_size=ffn,
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads, rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta or fam.hf_default_rope_theta),
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=cfg.get("tie_word_embeddings", False), qkv_bias=cfg.get("attention_bias", False),
    )
    kw.update(fam.hf_fields(cfg.get, kw))
    return ModelConfig(**kw)
