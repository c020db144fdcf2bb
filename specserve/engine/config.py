"""Engine configuration (frozen) and the KV memory budget."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from specserve.engine.step_budget import DEFAULT_MAX_STEP_MS
from specserve.errors import SpecserveError
from specserve.models.config import ModelConfig
from specserve.models.kv_cache import KV_DTYPES, kv_row_bytes, resolve_kv_dtype

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
    max_step_ms: float = DEFAULT_MAX_STEP_MS  # prefill chunks sized to this forward time; 0: fixed chunks
    encoder_cache_bytes: int = 256 << 20  # vision-encoder outputs kept by image content

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise SpecserveError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.max_step_ms < float("inf"):
            raise SpecserveError(f"--max-step-ms must be a number >= 0, got {self.max_step_ms}")
        if self.encoder_cache_bytes < 0:
            raise SpecserveError(f"--encoder-cache-memory must be >= 0, got {self.encoder_cache_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SpecserveError("--max-model-len must be >= 2")
        if self.kv_cache_dtype not in ("auto", *KV_DTYPES):
            raise SpecserveError(f"--kv-cache-dtype must be one of auto, {', '.join(KV_DTYPES)}; "
                                 f"got {self.kv_cache_dtype!r}")

    def context_len(self, model_max: int) -> int:
        """The context length served: --max-model-len, at most what the model was trained for."""
        return min(self.max_model_len or model_max, model_max)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len, block_size=args.block_size,
                   kv_cache_memory=args.kv_cache_memory, memory_fraction=args.gpu_memory_utilization,
                   kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
                   seed=args.seed, max_step_ms=getattr(args, "max_step_ms", DEFAULT_MAX_STEP_MS),
                   encoder_cache_bytes=getattr(args, "encoder_cache_memory", 256 << 20))


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
    kv_dtype: str = "fp32"
    max_num_seqs: int = 0
    pool_source: str = "available"  # what sized the pool: "--kv-cache-memory", "--memory" or "available"
    sliding_window: int = 0  # > 0: sliding-window layers keep only their window, in their own pool
    window_blocks: int = 0  # blocks of that fixed pool
    window_bytes: int = 0  # its bytes (it does not grow with the context)
    drafter_kv_bytes: int = 0  # a draft model's own KV pool (fixed size), inside drafter_bytes
    state_slots: int = 0  # hybrid models: recurrent-state slots (one per running sequence, plus one)
    state_planes: int = 0  # planes per slot: the committed state and one snapshot per row of a step
    state_checkpoints: int = 0  # prefix caching: states kept at block boundaries
    state_bytes: int = 0  # all of them (fixed: they do not grow with the context)
    vision_weight_bytes: int = 0  # an image-reading model's vision tower
    vision_activation_bytes: int = 0  # one tower forward at the largest image the preprocessing allows
    encoder_cache_bytes: int = 0  # image embeddings kept by content (engine/multimodal.py)

    @property
    def vision_bytes(self) -> int:
        return self.vision_weight_bytes + self.vision_activation_bytes + self.encoder_cache_bytes

    @property
    def pool_bytes(self) -> int:
        """All KV bytes: the pool that grows with the context plus the sliding-window pool."""
        return self.num_blocks * self.block_size * self.kv_bytes_per_token + self.window_bytes

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        """Weights (target and drafter), the drafter's own KV pool, the KV pool and the states."""
        return (self.weight_bytes + self.drafter_bytes + self.drafter_kv_bytes + self.pool_bytes + self.state_bytes
                + self.vision_bytes)

    @property
    def max_context(self) -> int:
        """The longest context one sequence alone could use: the pool, capped by max_model_len."""
        return min(self.pool_tokens, self.max_model_len)

    def concurrency_at(self, context: int) -> int:
        return self.num_blocks // -(-context // self.block_size)

    def to_dict(self) -> dict:
        return {
            "weight_bytes": self.weight_bytes, "drafter_bytes": self.drafter_bytes,
            "kv_cache_dtype": self.kv_dtype, "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size, "num_blocks": self.num_blocks, "pool_tokens": self.pool_tokens,
            "pool_bytes": self.pool_bytes, "total_bytes": self.total_bytes, "pool_source": self.pool_source,
            "available_bytes": self.available_bytes, "max_model_len": self.max_model_len,
            "max_context": self.max_context, "max_num_seqs": self.max_num_seqs,
            "concurrency_at_max_model_len": self.concurrency_at(self.max_model_len),
            "sliding_window": self.sliding_window, "window_blocks": self.window_blocks,
            "window_bytes": self.window_bytes, "drafter_kv_bytes": self.drafter_kv_bytes,
            "state_slots": self.state_slots, "state_planes": self.state_planes,
            "state_checkpoints": self.state_checkpoints, "state_bytes": self.state_bytes,
            "vision_weight_bytes": self.vision_weight_bytes, "vision_activation_bytes": self.vision_activation_bytes,
            "encoder_cache_bytes": self.encoder_cache_bytes,
        }


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str | torch.dtype = "fp32", num_layers: int | None = None) -> int:
    """Exact KV bytes one token takes in num_layers layers (default: all): K and V rows of every
    kv head, scales included (fp8_e4m3 / int8: one fp32 scale per row; int4: fp32 scale and min
    per 32 values). By default: every layer that keeps K/V (not a hybrid model's linear-attention
    layers)."""
    layers = len(cfg.attention_layers) if num_layers is None else num_layers
    return 2 * layers * cfg.num_kv_heads * kv_row_bytes(resolve_kv_dtype(kv_dtype), cfg.head_dim)


def window_paged(cfg: ModelConfig, max_model_len: int) -> bool:
    """Whether sliding-window layers get their own fixed pool: they exist, some layers are
    global (their cache grows), and a context can outgrow the window."""
    return 0 < cfg.sliding_window < max_model_len and 0 < cfg.num_global_layers < len(cfg.attention_layers)


def window_pool_blocks(cfg: ModelConfig, ecfg: EngineConfig, lookahead: int) -> int:
    """Blocks the sliding-window layers need at most: per running sequence the window, the
    partial blocks at both ends and one step's new tokens (lookahead = 1 + draft tokens), plus
    the step's prefill chunks (at most max_num_batched_tokens tokens over all sequences)."""
    bs = ecfg.block_size
    per_seq = -(-cfg.sliding_window // bs) + 2 + -(-lookahead // bs)
    return ecfg.max_num_seqs * per_seq + -(-ecfg.max_num_batched_tokens // bs)


def state_plan(cfg: ModelConfig, ecfg: EngineConfig, lookahead: int) -> tuple[int, int, int, int]:
    """(slots, planes per slot, checkpoints, bytes) of a hybrid model's recurrent states: a slot
    per running sequence plus one (start-up calibration), each holding the committed state and one
    snapshot per row a step can verify (lookahead = 1 + draft tokens), plus the prefix cache's
    checkpoints, in float32."""
    if not cfg.hybrid:
        return 0, 0, 0, 0
    slots, planes, (ckpts, _) = ecfg.max_num_seqs + 1, 1 + lookahead, state_checkpoints(ecfg)
    return slots, planes, ckpts, (slots * planes + ckpts) * cfg.state_bytes


STATE_CHECKPOINT_EVERY = 512  # tokens between a hybrid model's prefix-cache state checkpoints in a prefill


def state_checkpoints(ecfg: EngineConfig) -> tuple[int, int]:
    """(count, tokens between them) of a hybrid model's prefix-cache state checkpoints (count 0
    without prefix caching): the state every STATE_CHECKPOINT_EVERY tokens of a prompt (a whole
    number of blocks) and at its last full block, kept LRU."""
    every = max(STATE_CHECKPOINT_EVERY // ecfg.block_size, 1) * ecfg.block_size
    return (max(8, 2 * ecfg.max_num_seqs) if ecfg.enable_prefix_caching else 0), every


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
                drafter_bytes: int, available: int, device_type: str, *, kv_dtype: str = "fp32",
                total_memory: int | None = None, window: tuple[int, int, int] = (0, 0, 0),
                drafter_kv_bytes: int = 0, states: tuple[int, int, int, int] = (0, 0, 0, 0),
                vision: tuple[int, int, int] = (0, 0, 0)) -> MemoryPlan:
    """Size the KV pool; refuse when even one sequence at max_model_len cannot fit.

    The pool is ``--kv-cache-memory`` when given; else, with ``total_memory`` (the planner's
    ``--memory``: bytes for weights + KV), whatever the weights leave of it; else sized from the
    available memory, at most what max_num_seqs sequences of max_model_len need (and at most
    CPU_DEFAULT_KV_CAP on the CPU, where ``available`` is read with the weights loaded).
    ``window`` = (sliding window, its blocks, their bytes): a fixed pool for sliding-window layers,
    taken from the budget before the growing pool; ``states`` = (slots, planes, checkpoints, bytes)
    of a hybrid model's recurrent states, fixed too."""
    bs = ecfg.block_size
    blocks_one_seq = -(-max_model_len // bs)
    need = blocks_one_seq * bs * per_token
    # the drafter's own KV pool is fixed too, and so are the vision tower, its activations and outputs
    weights = weight_bytes + drafter_bytes + drafter_kv_bytes + sum(vision)
    # on the CPU ``available`` is read after the weights are loaded (they are out of it already);
    # what is allocated, or first touched, later must still fit in it
    later = drafter_kv_bytes + vision[1] + vision[2]
    fixed = window[2] + states[3]  # the sliding-window layers' pool, the recurrent states
    if ecfg.kv_cache_memory is not None:
        pool, source = ecfg.kv_cache_memory - fixed, "--kv-cache-memory"
    elif total_memory is not None:
        pool, source = total_memory - weights - fixed, "--memory"
        available = total_memory
    else:
        budget = int(available * ecfg.memory_fraction) - (weights if device_type == "cuda" else later) - fixed
        want = ecfg.max_num_seqs * blocks_one_seq * bs * per_token
        pool = min(budget, want, CPU_DEFAULT_KV_CAP if device_type == "cpu" else budget)
        source = "available"
    # no growing layer (all recurrent or windowed): the blocks only count positions, at no cost
    num_blocks = max(pool, 0) // (bs * per_token) if per_token else ecfg.max_num_seqs * blocks_one_seq
    if num_blocks < blocks_one_seq:
        have = f"the KV pool holds {num_blocks * bs} tokens ({max(pool, 0) / 2**20:.0f} MiB at {per_token} bytes/token)"
        fix_len = f"lower --max-model-len to {num_blocks * bs}" if num_blocks else "lower --max-model-len"
        if bs > max_model_len:  # one block is already more than the context: the block is the fault
            fix_len = f"lower --block-size {bs} (at most --max-model-len {max_model_len}; 16 is usual)"
        if source == "--kv-cache-memory":
            fix = f"raise --kv-cache-memory to at least {need + fixed} or {fix_len}"
        elif source == "--memory":
            have = (f"--memory {total_memory} leaves {max(pool, 0) / 2**20:.0f} MiB for the KV pool after "
                    f"{(weights + fixed) / 2**20:.0f} MiB of weights and fixed caches "
                    f"({num_blocks * bs} tokens at {per_token} bytes/token)")
            fix = f"raise --memory to at least {weights + fixed + need} or {fix_len}"
        else:
            fix = f"{fix_len}, use a smaller --kv-cache-dtype, or set --kv-cache-memory to at least {need + fixed}"
        raise SpecserveError(f"{have} but one sequence at --max-model-len {max_model_len} needs "
                             f"{need / 2**20:.0f} MiB: {fix}")
    kv_total = num_blocks * bs * per_token + fixed
    if total_memory is not None and source == "--kv-cache-memory" and weights + kv_total > total_memory:
        raise SpecserveError(f"--kv-cache-memory's pool ({kv_total / 2**20:.0f} MiB) and {weights / 2**20:.0f} MiB "
                             f"of weights do not fit in --memory {total_memory / 2**20:.0f} MiB: lower "
                             f"--kv-cache-memory or raise --memory")
    if device_type == "cpu" and total_memory is None and later + kv_total > available:
        extra = f" plus {later / 2**20:.0f} MiB of drafter KV and vision buffers" if later else ""
        raise SpecserveError(f"the KV pool ({kv_total / 2**20:.0f} MiB){extra} does not fit in the "
                             f"{available / 2**20:.0f} MiB of memory left after loading "
                             f"{(weights - later) / 2**20:.0f} MiB of weights: lower --kv-cache-memory")
    return MemoryPlan(weight_bytes, drafter_bytes, per_token, int(num_blocks), bs, max_model_len, available,
                      kv_dtype, ecfg.max_num_seqs, source, *window, drafter_kv_bytes, *states, *vision)


def engine_plan(ecfg: EngineConfig, mcfg: ModelConfig, model_dtype: torch.dtype, device: torch.device,
                weight_bytes: int, drafter_bytes: int, total_memory: int | None = None, lookahead: int = 1,
                drafter_kv_bytes: int = 0, vision: tuple[int, int, int] = (0, 0, 0), share: int = 1) -> MemoryPlan:
    """The engine's memory plan for a loaded model (what LLMEngine and ``specserve plan`` use).
    share: tensor-parallel ranks on this machine, each planned with its part of the free memory.
    vision: (tower weights, activations, encoder-output cache) bytes of an image-reading model.
    lookahead: tokens a decode step adds per sequence (1 + speculative tokens)."""
    kv_dtype = resolve_kv_dtype(ecfg.kv_cache_dtype, device.type, model_dtype)
    if device.type != "cpu" and kv_dtype in ("fp8_e4m3", "int8", "int4"):
        raise SpecserveError(f"--kv-cache-dtype {kv_dtype} is not supported on CUDA yet (use auto, bf16 or fp16)")
    max_model_len = ecfg.context_len(mcfg.max_position)
    if total_memory is not None:
        total_memory //= share
    available = available_memory(device) // share if total_memory is None else total_memory
    growing, window = len(mcfg.attention_layers), (0, 0, 0)
    if window_paged(mcfg, max_model_len):
        growing = mcfg.num_global_layers
        nb = window_pool_blocks(mcfg, ecfg, lookahead)
        window = (mcfg.sliding_window, nb,
                  nb * ecfg.block_size * kv_bytes_per_token(mcfg, kv_dtype, len(mcfg.attention_layers) - growing))
    return plan_memory(ecfg, kv_bytes_per_token(mcfg, kv_dtype, growing), max_model_len, weight_bytes, drafter_bytes,
                       available, device.type, kv_dtype=kv_dtype, total_memory=total_memory, window=window,
                       drafter_kv_bytes=drafter_kv_bytes, states=state_plan(mcfg, ecfg, lookahead), vision=vision)
