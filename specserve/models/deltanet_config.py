"""The shapes of a hybrid model's Gated DeltaNet (linear-attention) layers and of a
mixture-of-experts MLP (Qwen3-Next)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import ModelLoadError


@dataclass(frozen=True)
class DeltaNetConfig:
    """The Gated DeltaNet (linear attention) layers of a hybrid model."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    # value heads in llama.cpp's tiled order (v head h reads k head h % num_k_heads) instead of the
    # checkpoint's grouped order (h // (num_v_heads / num_k_heads)): its converter reorders them
    v_tiled: bool = False

    def __post_init__(self) -> None:
        if min(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim, self.conv_kernel) < 1:
            raise ModelLoadError(f"invalid linear-attention shape {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ModelLoadError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                                 f"linear_num_key_heads {self.num_k_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_floats(self) -> int:
        """float32 values of one sequence's state in one layer: the conv window and S."""
        return (self.conv_kernel - 1) * self.conv_dim + self.num_v_heads * self.k_head_dim * self.v_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: a router over num_experts experts, the top num_experts_per_tok per token
    (renormalised when norm_topk_prob), plus a shared expert behind a sigmoid gate."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # of each expert
    shared_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True
    sparse_step: int = 1  # every sparse_step-th layer is sparse ...
    dense_layers: tuple[int, ...] = ()  # ... except these (mlp_only_layers)

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts}")

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0
