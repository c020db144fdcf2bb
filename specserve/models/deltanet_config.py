"""The shapes of a hybrid model's Gated DeltaNet (linear-attention) layers."""

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
