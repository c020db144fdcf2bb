"""The paged KV cache: per-layer K/V pools in one of several storage formats.

``--kv-cache-dtype``:

========== ============================================================ ==========================
dtype      storage per (token, kv head) row of head_dim D values         bytes per row
========== ============================================================ ==========================
fp32       D float32                                                    4 D
bf16       D bfloat16 (round to nearest even)                           2 D
fp16       D float16 (round to nearest even)                            2 D
fp8_e4m3   D e4m3fn bytes + one fp32 scale (absmax / 448)               D + 4
int8       D int8 + one fp32 scale (absmax / 127, symmetric)            D + 4
int4       D / 2 bytes, asymmetric groups of 32 along head_dim, each     D / 2 + 8 D / 32
           with an fp32 (scale, min): x ~= q * scale + min, q in 0..15
========== ============================================================ ==========================

``auto`` is fp32 on the CPU and the model's activation dtype on CUDA (bf16 by default).

Values are quantized when written (:meth:`KVCache.write`, elementwise given each row's or
group's max/min, so a token's stored bytes depend on its own K/V only) and dequantized inside
the attention kernel while it reads them. The CPU kernel then runs the fp32 arithmetic in its
fixed order, so attention stays batch-invariant with every dtype: speculative decoding with a
quantized cache reproduces plain decoding with the same quantized cache token for token. (It is
*not* the fp32-cache output: quantization changes the numbers; see benchmarks/kv_dtypes.py.)

On CUDA only fp32 / bf16 / fp16 are supported so far.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch

from specserve.errors import SpecserveError
from specserve.kernels import ops
from specserve.models.config import ModelConfig

KV_DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "int8", "int4")
QUANTIZED = ("fp8_e4m3", "int8", "int4")
_FROM_TORCH = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_kv_dtype(name: str | torch.dtype, device_type: str = "cpu",
                     model_dtype: torch.dtype = torch.float32) -> str:
    """The storage format for ``--kv-cache-dtype name`` ("auto": fp32 on CPU, the model's
    activation dtype on CUDA, bf16 by default). A torch dtype is accepted too."""
    if isinstance(name, torch.dtype):
        if name not in _FROM_TORCH:
            raise SpecserveError(f"unsupported KV cache dtype {name}")
        return _FROM_TORCH[name]
    if name == "auto":
        if device_type == "cpu":
            return "fp32"
        return _FROM_TORCH.get(model_dtype, "bf16")
    if name not in KV_DTYPES:
        raise SpecserveError(f"unknown --kv-cache-dtype {name!r} (choose from auto, {', '.join(KV_DTYPES)})")
    return name


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Exact bytes of one (token, kv head) row of K (or V), scales included."""
    return ops.kv_row_bytes(resolve_kv_dtype(kv_dtype), head_dim)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. On the CPU an anonymous memory mapping of its own: the OS hands out
    zeroed pages as they are first written, so a pool of many GB costs nothing at start-up
    (torch.zeros writes every byte: seconds; calloc does too when the heap has freed memory to
    reuse) and memory is committed as sequences fill it. Unmapped when the tensor goes."""
    if device.type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8).view(dtype).reshape(shape)


@dataclass
class KVCache:
    """Per-layer K/V pools [num_blocks, block_size, num_kv_heads, head_dim] (int4: head_dim / 2
    bytes) in the storage format ``kv_dtype``, plus per-layer scale pools for the quantized
    formats ([num_blocks, block_size, num_kv_heads] for fp8_e4m3 / int8,
    [..., num_kv_heads, head_dim / 32, 2] (scale, min) for int4)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    kv_dtype: str = "fp32"
    k_scales: list[torch.Tensor] | None = None
    v_scales: list[torch.Tensor] | None = None
    head_dim: int = 0
    _extra: list[dict] = field(default_factory=list, repr=False)
    states: object = None  # a hybrid model's recurrent states (models.hybrid.RecurrentStates)
    groups: tuple[int, ...] = ()  # each layer's paged cache group (the batch's paging it uses); () all 0

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int,
                 kv_dtype: str | torch.dtype = "fp32", device: torch.device | str = "cpu",
                 window_blocks: int | None = None) -> "KVCache":
        """Pools of num_blocks blocks; with window_blocks, sliding-window layers get pools of
        that many blocks instead (they only ever hold each sequence's last window). A hybrid
        model's linear-attention layers keep no K/V: their pools are empty."""
        device = torch.device(device)
        name = resolve_kv_dtype(kv_dtype, device.type)
        if device.type != "cpu" and name in QUANTIZED:
            raise SpecserveError(f"--kv-cache-dtype {name} is not supported on CUDA yet "
                                 f"(use auto, fp32, bf16 or fp16)")
        D, hkv = cfg.head_dim, cfg.num_kv_heads
        _, store = ops.KV_FORMATS[name]
        own = [window_blocks is not None and cfg.sliding(i) and not cfg.is_linear(i) for i in range(cfg.num_layers)]
        blocks = [0 if cfg.is_linear(i) else window_blocks if own[i] else num_blocks for i in range(cfg.num_layers)]

        def pools(tail: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            return [zeros((nb, block_size, hkv, *tail), dtype, device) for nb in blocks]

        k, v = pools((ops.kv_store_dim(name, D),), store), pools((ops.kv_store_dim(name, D),), store)
        ks = vs = None
        sshape = ops.kv_scale_shape(name, D)
        if sshape is not None:
            ks, vs = pools(tuple(sshape), torch.float32), pools(tuple(sshape), torch.float32)
        return cls(k, v, name, ks, vs, D, groups=tuple(int(o) for o in own) if any(own) else ())

    def __post_init__(self) -> None:
        if not self.head_dim and self.k:
            self.head_dim = self.k[0].shape[-1] * (2 if self.kv_dtype == "int4" else 1)
        if self.kv_dtype == "fp32":
            self._extra = [{} for _ in self.k]
        else:
            self._extra = [{"kv_dtype": self.kv_dtype,
                            "k_scales": None if self.k_scales is None else self.k_scales[i],
                            "v_scales": None if self.v_scales is None else self.v_scales[i]}
                           for i in range(len(self.k))]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def group(self, layer: int) -> int:
        """The paged cache group of the layer's pool: 0 (the full-attention pool), or 1 for a
        sliding-window layer whose pool is its own (allocated with window_blocks)."""
        return self.groups[layer] if self.groups else 0

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V rows k, v [T, Hkv, D] of one layer at the flat slots slot_mapping [T]."""
        kp, vp = self.k[layer], self.v[layer]
        hkv, dst = kp.shape[2], kp.shape[3]
        if self.k_scales is None:
            kp.view(-1, hkv, dst)[slot_mapping] = k.to(kp.dtype)
            vp.view(-1, hkv, dst)[slot_mapping] = v.to(vp.dtype)
            return
        ks, vs = self.k_scales[layer], self.v_scales[layer]
        tail = tuple(ks.shape[3:])
        for data_pool, scale_pool, x in ((kp, ks, k), (vp, vs, v)):
            data, scales = ops.kv_quantize(x, self.kv_dtype)
            data_pool.view(-1, hkv, dst)[slot_mapping] = data
            scale_pool.view(-1, hkv, *tail)[slot_mapping] = scales

    def attention_args(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(k_pool, v_pool, extra keyword arguments of layers.paged_attention) for one layer."""
        return self.k[layer], self.v[layer], self._extra[layer]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized fp32 K, V [N, Hkv, D] at flat slots (for tests and tools)."""
        out = []
        for pool, spool in ((self.k[layer], self.k_scales), (self.v[layer], self.v_scales)):
            hkv, dst = pool.shape[2], pool.shape[3]
            data = pool.view(-1, hkv, dst)[slots]
            scales = None if spool is None else spool[layer].view(-1, hkv, *spool[layer].shape[3:])[slots]
            out.append(ops.kv_dequantize(data, scales, self.kv_dtype))
        return out[0], out[1]

    def nbytes(self) -> int:
        """Bytes held by the pools (data and scales)."""
        tensors = self.k + self.v + (self.k_scales or []) + (self.v_scales or [])
        return sum(t.numel() * t.element_size() for t in tensors)
