"""Split a dense model's tensors across tensor-parallel ranks (Megatron-style).

Column-parallel (output rows split): q/k/v by heads and gate/up by intermediate channels; the
rows of one rank are a contiguous run, so each rank's activations are its own heads / channels.
Row-parallel (input columns split): o and down, whose partial sums the ranks add with one
all-reduce. Vocab-parallel: the embedding table and the LM head by vocabulary rows. Norms are
replicated. Fewer KV heads than ranks: each KV head is replicated on the ranks whose query
heads read it (vLLM's rule), so a rank keeps ``max(1, kv_heads / world)`` of them.

GGUF block weights stay in their blocks: a row split takes whole rows, a column split whole
blocks when the cut falls on a block boundary (the MLP's cut is moved to one; a head cut that
is not on one dequantizes that weight, logged). The split needs nothing but the tensors and the
config, so ``specserve plan -tp N`` sizes every rank without starting one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from specserve.errors import SpecserveError
from specserve.models.config import ModelConfig
from specserve.models.weights import RawTensor

log = logging.getLogger("specserve.parallel")

COLUMN = ("q", "k", "v", "gate", "up")  # output rows split
ROW = ("o", "down")  # input columns split, partial sums all-reduced


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` tensor-parallel ranks."""

    rank: int
    world: int

    @property
    def active(self) -> bool:
        return self.world > 1


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Refuse a model this many ranks cannot split, naming why (at start-up, before any load)."""
    if world <= 1:
        return
    if cfg.hybrid or cfg.moe is not None:
        raise SpecserveError(f"--tensor-parallel-size {world}: {cfg.arch} (hybrid linear-attention or "
                             "mixture-of-experts layers) is not sharded yet; dense families only")
    if cfg.attn_output_gate:
        raise SpecserveError(f"--tensor-parallel-size {world}: gated attention output is not sharded yet")
    if cfg.num_heads % world:
        raise SpecserveError(f"--tensor-parallel-size {world} does not divide the {cfg.num_heads} attention "
                             f"heads of this model")
    kv = cfg.num_kv_heads
    if kv % world and world % kv:
        raise SpecserveError(f"--tensor-parallel-size {world} and the model's {kv} KV heads: one must divide "
                             "the other")


def rank_config(cfg: ModelConfig, shard: Shard, intermediate: int) -> ModelConfig:
    """The shapes one rank computes: its heads, its KV heads and its MLP channels."""
    return replace(cfg, num_heads=cfg.num_heads // shard.world,
                   num_kv_heads=max(1, cfg.num_kv_heads // shard.world), intermediate_size=intermediate)


def vocab_rows(vocab: int, shard: Shard) -> tuple[int, int]:
    """(first row, rows) of the vocabulary on this rank: ceil(V / world) per rank, the last fewer."""
    per = -(-vocab // shard.world)
    start = min(shard.rank * per, vocab)
    return start, min(per, vocab - start)


def _block(raw: RawTensor) -> int:
    """Elements per stored block along a row (1 for float data)."""
    if raw.qtype == "torch" or raw.qtype in ("F32", "F16", "BF16"):
        return 1
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[raw.qtype]][0]


def split_points(total: int, world: int, align: int) -> list[int]:
    """world + 1 cut points of [0, total], each on a multiple of align, as even as they can be."""
    units = total // align
    if units * align != total or units < world:
        return [round(total * r / world) for r in range(world + 1)]
    return [(units * r // world) * align for r in range(world)] + [total]


def take_rows(raw: RawTensor, start: int, stop: int) -> RawTensor:
    """Output rows [start, stop) of a weight or vector, in its stored format where it has one."""
    shape = (stop - start,) + tuple(raw.shape[1:])
    if raw.qtype == "torch" or len(raw.shape) == 1 or raw.qtype in ("F32", "F16", "BF16"):
        return RawTensor(raw.name, shape, "torch", raw.dequantize()[start:stop].contiguous())
    rows = raw.raw_rows()[start:stop].numpy()  # the row permutation applied
    return RawTensor(raw.name, shape, raw.qtype, rows)


def take_columns(raw: RawTensor, start: int, stop: int) -> RawTensor:
    """Input columns [start, stop) of a weight: whole blocks when the cut allows, else dequantized."""
    shape = (raw.shape[0], stop - start)
    bs = _block(raw)
    if bs == 1 or start % bs or stop % bs:
        if bs != 1:
            log.info("%s: columns %d:%d are not on its %d-element blocks, kept dequantized", raw.name, start,
                     stop, bs)
        return RawTensor(raw.name, shape, "torch", raw.dequantize()[:, start:stop].contiguous())
    rows = raw.raw_rows().numpy()
    per_block = rows.shape[1] // (raw.shape[1] // bs)
    return RawTensor(raw.name, shape, raw.qtype, np.ascontiguousarray(rows[:, start // bs * per_block:
                                                                             stop // bs * per_block]))


def shard_tensors(cfg: ModelConfig, tensors: dict[str, RawTensor], shard: Shard
                  ) -> tuple[ModelConfig, dict[str, RawTensor]]:
    """(this rank's config, its tensors) of a dense model."""
    check_shardable(cfg, shard.world)
    r, n, d = shard.rank, shard.world, cfg.head_dim
    hq = cfg.num_heads // n
    kv_per = max(1, cfg.num_kv_heads // n)
    kv_first = r * cfg.num_kv_heads // n  # (fewer KV heads than ranks: the one rank r's queries read)
    down0 = tensors["layers.0.down"]
    cuts = split_points(cfg.intermediate_size, n, max(_block(down0), 1))
    mlp = (cuts[r], cuts[r + 1])
    heads = {"q": (r * hq * d, (r + 1) * hq * d), "k": (kv_first * d, (kv_first + kv_per) * d)}
    heads["v"] = heads["k"]
    out: dict[str, RawTensor] = {}
    for name, raw in tensors.items():
        part, _, leaf = name.rpartition(".")
        base = leaf.removesuffix("_bias")
        if not part.startswith("layers."):
            out[name] = raw
        elif base in ("q", "k", "v"):
            out[name] = take_rows(raw, *heads[base])
        elif base in ("gate", "up"):
            out[name] = take_rows(raw, *mlp)
        elif leaf == "o":
            out[name] = take_columns(raw, *heads["q"])
        elif leaf == "down":
            out[name] = take_columns(raw, *mlp)
        elif leaf.endswith("_bias") and base in ROW:  # added once, on rank 0
            out[name] = raw if r == 0 else RawTensor(name, raw.shape, "torch", torch.zeros(raw.shape))
        else:
            out[name] = raw  # norms and other per-channel vectors
    start, rows = vocab_rows(cfg.vocab_size, shard)
    for name in ("embed", "lm_head"):
        if name in tensors:
            out[name] = take_rows(tensors[name], start, start + rows)
    return rank_config(cfg, shard, mlp[1] - mlp[0]), out
