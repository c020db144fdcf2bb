"""Engine configuration (frozen) and the KV memory budget."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from specserve.errors import SpecserveError
from specserve.models.config import ModelConfig

GiB = 1 << 30
CPU_DEFAULT_KV_CAP = 2 * GiB  # default pool cap on CPU when --kv-cache-memory is not given


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's maximum
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: sized from free memory
    memory_fraction: float = 0.9
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise SpecserveError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SpecserveError("--max-model-len must be >= 2")
        if self.kv_cache_dtype not in ("auto", "fp32"):
            raise SpecserveError(f"--kv-cache-dtype {self.kv_cache_dtype} is not implemented yet (use auto)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len, block_size=args.block_size,
                   kv_cache_memory=args.kv_cache_memory, memory_fraction=args.gpu_memory_utilization,
                   kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
                   seed=args.seed)


@dataclass(frozen=True)
class MemoryPlan:
    """How the memory budget splits between weights and the KV pool."""

    weight_bytes: int
    drafter_bytes: int
    kv_bytes_per_token: int
    num_blocks: int
    block_size: int
    max_model_len: int
    available_bytes: int

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def concurrency_at(self, context: int) -> int:
        return self.num_blocks // -(-context // self.block_size)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    # Gemma 3's sliding layers are paged like the others for now, so every layer counts.
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * GiB


def plan_memory(ecfg: EngineConfig, per_token: int, max_model_len: int, weight_bytes: int,
                drafter_bytes: int, available: int, device_type: str) -> MemoryPlan:
    """Size the KV pool; refuse when even one sequence at max_model_len cannot fit."""
    bs = ecfg.block_size
    blocks_one_seq = -(-max_model_len // bs)
    if ecfg.kv_cache_memory is not None:
        pool = ecfg.kv_cache_memory
    else:
        budget = int(available * ecfg.memory_fraction) - (weight_bytes + drafter_bytes if device_type == "cuda" else 0)
        want = ecfg.max_num_seqs * blocks_one_seq * bs * per_token
        pool = min(budget, want, CPU_DEFAULT_KV_CAP if device_type == "cpu" else budget)
    num_blocks = pool // (bs * per_token)
    if num_blocks < blocks_one_seq:
        need = blocks_one_seq * bs * per_token
        raise SpecserveError(
            f"the KV pool holds {num_blocks * bs} tokens ({pool / 2**20:.0f} MiB at {per_token} bytes/token) but "
            f"one sequence at --max-model-len {max_model_len} needs {need / 2**20:.0f} MiB: raise --kv-cache-memory "
            f"to at least {need} or lower --max-model-len to {num_blocks * bs}")
    if device_type == "cpu" and weight_bytes + drafter_bytes + num_blocks * bs * per_token > available:
        raise SpecserveError(f"weights ({weight_bytes / 2**20:.0f} MiB) plus the KV pool "
                             f"({num_blocks * bs * per_token / 2**20:.0f} MiB) do not fit in the "
                             f"{available / 2**20:.0f} MiB of available memory: lower --kv-cache-memory")
    return MemoryPlan(weight_bytes, drafter_bytes, per_token, int(num_blocks), bs, max_model_len, available)
