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

ROW = ("o", "down")  # input columns split, partial sums all-reduced (their biases added on rank 0 only)


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
    dn = cfg.deltanet
    if cfg.hybrid and (dn.num_k_heads % world or dn.num_v_heads % world):
        raise SpecserveError(f"--tensor-parallel-size {world} does not divide the linear-attention layers' "
                             f"{dn.num_k_heads} key / {dn.num_v_heads} value heads")
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
    if raw.is_float:
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
    if raw.is_float or len(raw.shape) == 1:
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


def _cut(total: int, shard: Shard, raw: RawTensor | None) -> tuple[int, int]:
    """This rank's run of an MLP's channels, on raw's (the down projection's) block boundaries."""
    cuts = split_points(total, shard.world, _block(raw) if raw is not None else 1)
    return cuts[shard.rank], cuts[shard.rank + 1]


def _runs(heads: list[int], width: int, offset: int = 0) -> list[int]:
    """The channel indices of these heads, each width wide, after offset."""
    return [offset + h * width + j for h in heads for j in range(width)]


class _Plan:
    """Which rows / columns of each kind of tensor rank r keeps."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, RawTensor], shard: Shard):
        r, n, d = shard.rank, shard.world, cfg.head_dim
        hq, kv_per = cfg.num_heads // n, max(1, cfg.num_kv_heads // n)
        kv_first = r * cfg.num_kv_heads // n  # (fewer KV heads than ranks: the one rank r's queries read)
        qd = 2 * d if cfg.attn_output_gate else d  # a gated q projection: each head's query then its gate
        self.q, self.o = (r * hq * qd, (r + 1) * hq * qd), (r * hq * d, (r + 1) * hq * d)
        self.kv = (kv_first * d, (kv_first + kv_per) * d)
        dense_down = next((t for k, t in tensors.items() if k.endswith(".down") and ".expert" not in k
                           and ".shexp" not in k), None)
        self.mlp = _cut(cfg.intermediate_size, shard, dense_down)
        moe = cfg.moe
        self.expert = _cut(moe.intermediate_size, shard, _first(tensors, ".expert0.down")) if moe else None
        self.shexp = (_cut(moe.shared_intermediate_size, shard, _first(tensors, ".shexp.down"))
                      if moe and moe.shared_intermediate_size else None)
        dn = cfg.deltanet
        if dn is not None:
            hk, hv = dn.num_k_heads // n, dn.num_v_heads // n
            k_heads = list(range(r * hk, (r + 1) * hk))
            v_heads = (sorted(h for h in range(dn.num_v_heads) if h % dn.num_k_heads in k_heads) if dn.v_tiled
                       else list(range(r * hv, (r + 1) * hv)))
            self.v_heads = v_heads
            self.conv = (_runs(k_heads, dn.k_head_dim) + _runs(k_heads, dn.k_head_dim, dn.key_dim)
                         + _runs(v_heads, dn.v_head_dim, 2 * dn.key_dim))
            self.value = _runs(v_heads, dn.v_head_dim)

    def rank_config(self, cfg: ModelConfig, shard: Shard) -> ModelConfig:
        n = shard.world
        out = rank_config(cfg, shard, self.mlp[1] - self.mlp[0])
        if cfg.moe is not None:
            out = replace(out, moe=replace(cfg.moe, intermediate_size=self.expert[1] - self.expert[0],
                                           shared_intermediate_size=(self.shexp[1] - self.shexp[0]) if self.shexp
                                           else 0))
        if cfg.deltanet is not None:
            dn = cfg.deltanet
            out = replace(out, deltanet=replace(dn, num_k_heads=dn.num_k_heads // n, num_v_heads=dn.num_v_heads // n))
        return out

    def split(self, name: str, raw: RawTensor, rank: int) -> RawTensor:
        """The part of layer tensor ``name`` this rank keeps."""
        part, _, leaf = name.rpartition(".")
        base = leaf.removesuffix("_bias")
        mlp = self.expert if ".expert" in part else self.shexp if part.endswith(".shexp") else self.mlp
        if base == "q":
            return take_rows(raw, *self.q)
        if base in ("k", "v"):
            return take_rows(raw, *self.kv)
        if base in ("gate", "up"):
            return take_rows(raw, *mlp)
        if leaf == "o":
            return take_columns(raw, *self.o)
        if leaf == "down":
            return take_columns(raw, *mlp)
        if leaf in ("attn_qkv", "ssm_conv1d"):
            return take_index(raw, self.conv)
        if leaf == "attn_gate":
            return take_index(raw, self.value)
        if leaf in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_a_log", "ssm_dt", "ssm_dt_bias"):
            return take_index(raw, self.v_heads)
        if leaf == "ssm_out":
            return take_column_index(raw, self.value)
        if leaf.endswith("_bias") and base in ROW:  # added once, on rank 0
            return raw if rank == 0 else RawTensor(name, raw.shape, "torch", torch.zeros(raw.shape))
        return raw  # norms, the router, a shared expert's gate: replicated


def _first(tensors: dict[str, RawTensor], suffix: str) -> RawTensor | None:
    return next((t for k, t in tensors.items() if k.endswith(suffix)), None)


def take_index(raw: RawTensor, idx: list[int]) -> RawTensor:
    """Output rows idx (ascending) of a weight or vector (a vector of per-head values, a conv)."""
    shape = (len(idx),) + tuple(raw.shape[1:])
    if len(raw.shape) == 2 and not raw.is_float:  # whole rows: blocks kept
        return RawTensor(raw.name, shape, raw.qtype, raw.raw_rows()[torch.tensor(idx)].numpy())
    flat = raw.dequantize()
    return RawTensor(raw.name, shape, "torch", flat.reshape(raw.shape)[torch.tensor(idx)].contiguous())


def take_column_index(raw: RawTensor, idx: list[int]) -> RawTensor:
    """Input columns idx (ascending) of a weight: whole blocks when they are one aligned run."""
    if idx == list(range(idx[0], idx[-1] + 1)):
        return take_columns(raw, idx[0], idx[-1] + 1)
    return RawTensor(raw.name, (raw.shape[0], len(idx)), "torch", raw.dequantize()[:, torch.tensor(idx)].contiguous())


def shard_tensors(cfg: ModelConfig, tensors: dict[str, RawTensor], shard: Shard
                  ) -> tuple[ModelConfig, dict[str, RawTensor]]:
    """(this rank's config, its tensors)."""
    check_shardable(cfg, shard.world)
    plan = _Plan(cfg, tensors, shard)
    out = {name: plan.split(name, raw, shard.rank) if name.startswith("layers.") else raw
           for name, raw in tensors.items()}
    start, rows = vocab_rows(cfg.vocab_size, shard)
    for name in ("embed", "lm_head"):
        if name in tensors:
            out[name] = take_rows(tensors[name], start, start + rows)
    return plan.rank_config(cfg, shard), out
