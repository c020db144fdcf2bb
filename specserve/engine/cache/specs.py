"""What each layer keeps between steps, declared per layer group.

A spec is a frozen description, not storage: the memory plan sums the specs' bytes, and the
coordinator builds one manager per spec. ``layer_cache_specs`` derives the groups of a model from
its config (``ModelConfig.sliding(i)``, ``ModelConfig.is_linear(i)``: a hybrid model's
recurrent layers add a :class:`RecurrentStateSpec` group)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.models.config import ModelConfig


@dataclass(frozen=True)
class FullAttentionSpec:
    """K/V of every token so far: paged in blocks, grows with the context, prefix-cacheable."""

    layers: tuple[int, ...]
    block_size: int
    bytes_per_token: int  # K and V over all of this group's layers, scales included
    kind = "full_attention"

    def bytes_for(self, num_blocks: int) -> int:
        return num_blocks * self.block_size * self.bytes_per_token


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K/V of the last ``window`` tokens: blocks that slide out of the window go back to the pool,
    so the pool is fixed in size (see ``engine.config.window_pool_blocks``)."""

    window: int = 0
    kind = "sliding_window"


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A fixed-size state per sequence (a conv window and a linear-attention state, say), with
    ``num_snapshots`` extra planes: one per row a step may verify, so rolling back to any accepted
    count is an index move, never a recompute."""

    layers: tuple[int, ...]
    state_bytes: int  # one sequence's state over all of this group's layers
    num_snapshots: int  # rows a step can add: 1 + the largest draft
    checkpoints: int = 0  # prefix caching: states kept at block boundaries, in a pool of this many
    checkpoint_every: int = 0  # tokens between checkpoints in a prefill (a multiple of the block size)
    block_size: int = 16  # the full-attention blocks the checkpoints are keyed by
    kind = "recurrent"

    @property
    def planes(self) -> int:
        """State planes per slot: the committed state plus one snapshot per row of a step."""
        return 1 + self.num_snapshots

    def bytes_for(self, num_slots: int) -> int:
        return (num_slots * self.planes + self.checkpoints) * self.state_bytes


CacheSpec = FullAttentionSpec | SlidingWindowSpec | RecurrentStateSpec


def layer_cache_specs(cfg: ModelConfig, block_size: int, bytes_per_layer_token: int,
                      window_paged: bool, lookahead: int = 1, checkpoints: tuple[int, int] = (0, 0)
                      ) -> tuple[CacheSpec, ...]:
    """The model's cache groups: its full-attention layers, then (when ``window_paged``: some
    layers slide and a context can outgrow the window) its sliding-window layers in a group of
    their own, then a hybrid model's linear-attention layers (a recurrent state with a snapshot
    per row a step can add: lookahead = 1 + draft tokens; checkpoints = (pool size, tokens between
    them) for prefix caching). Without window paging, sliding layers live in the full-attention pool
    and the attention kernel applies the window."""
    layers = cfg.attention_layers
    sliding = tuple(i for i in layers if cfg.sliding(i)) if window_paged else ()
    full = tuple(i for i in layers if i not in sliding)
    specs: list[CacheSpec] = [FullAttentionSpec(full, block_size, bytes_per_layer_token * len(full))]
    if sliding:
        specs.append(SlidingWindowSpec(sliding, block_size, bytes_per_layer_token * len(sliding),
                                       window=cfg.sliding_window))
    if cfg.linear_layers:
        linear = cfg.linear_layers
        specs.append(RecurrentStateSpec(linear, cfg.state_bytes, lookahead,
                                        *checkpoints, block_size=block_size))
    return tuple(specs)
