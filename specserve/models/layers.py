"""Building blocks of the decoder: linear layers in several weight formats, norms, rope, attention.

On CPU every op that reduces goes through specserve.kernels, whose results for a row do not
depend on how many rows are in the call (batch invariance: what keeps speculation lossless).
On CUDA the same functions use torch's kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels import ops
from specserve.kernels.grouped import top_k_experts
from specserve.models import device_attention
from specserve.models.weights import RawTensor

# CUDA: a linear's rows go through cuBLAS in tiles of this many (the last one padded), so every
# row is computed by the same kernel whatever else is in the batch (cuBLAS picks its kernel, and
# with it the order of a row's sums, by the matrix shapes). 0: one call over every row.
CUDA_ROW_TILE = 64
# GGUF block formats our CPU kernels read directly (no re-quantization)
NATIVE_GGUF = frozenset(ops.GGUF_QTYPES)


# GGUF formats of 4.5 bits per weight or less, kept as stored by --quantization q4_0
SMALL_GGUF = frozenset({"Q4_0", "Q4_1", "Q4_K"})


def cpu_format(raw: RawTensor, quant: str) -> str:
    """How a weight is kept on CPU under --quantization quant: "native" (the file's GGUF blocks),
    "Q4_0" (re-quantized to 4 bits), "int8" or "fp32"."""
    if quant == "q4" and raw.qtype in NATIVE_GGUF:
        return "native"
    if quant == "q4_0":
        if raw.qtype in SMALL_GGUF:
            return "native"
        if raw.shape[1] % 32 == 0:
            return "Q4_0"
    if quant in ("int8", "q4", "q4_0"):
        return "int8"
    return "fp32"


class Linear(nn.Module):
    """y = x W^T (+ b) with W kept in one run-time format.

    On CPU, int8 and GGUF block weights multiply int8-quantized activations in integer arithmetic
    (the kernels' integer-dot path, see specserve.kernels.ops); fp32 weights use fp32 activations.

    ``parallel`` declares how tensor parallelism splits it (parallel/shard.py cuts the checkpoint
    the same way; tests/test_modules.py checks that they agree): "column" (output rows), "row"
    (input columns: each rank's output is a partial sum, summed here), "row_partial" (the same
    split, summed by the owner: a mixture's experts), "vocab" (the LM head's vocabulary rows) or
    "replicated". ``reduce_group``, set on the "row" ones by the model's
    :meth:`attach_tensor_parallel`, all-reduces the output (the row-parallel bias is rank 0's
    only, so it is added once).
    """

    def __init__(self, raw: RawTensor, bias: torch.Tensor | None, quant: str, device: torch.device,
                 dtype: torch.dtype, parallel: str = "replicated"):
        super().__init__()
        self.out_features, self.in_features = raw.shape
        self.device, self.parallel, self.reduce_group = device, parallel, None
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32 if device.type == "cpu" else dtype)
        kind = cpu_format(raw, quant) if device.type == "cpu" else "device"
        if kind == "device":
            self.weight = raw.dequantize().to(device=device, dtype=dtype)
            self.format = str(dtype).removeprefix("torch.")
        elif kind == "native":
            self.weight = ops.GGUFBlockWeight.from_raw(raw.raw_rows(), raw.qtype, *raw.shape)
            self.format = raw.qtype
        elif kind == "Q4_0":
            self.weight = ops.GGUFBlockWeight.from_float(raw.dequantize(), "Q4_0")
            self.format = "Q4_0"
        elif kind == "int8":
            self.weight = ops.Int8Weight.from_float(raw.dequantize())
            self.format = "int8"
        else:
            self.weight = ops.F32Weight(raw.dequantize())
            self.format = "fp32"

    @classmethod
    def of_weight(cls, weight, bias: torch.Tensor | None, device: torch.device, fmt: str,
                  parallel: str = "replicated") -> "Linear":
        """A linear over a weight already in its run-time format (a kernel weight or a tensor)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.out_features, out.in_features = weight.shape
        out.device, out.parallel, out.reduce_group = device, parallel, None
        out.weight, out.bias, out.format = weight, bias, fmt
        return out

    @classmethod
    def fused(cls, raws: list[RawTensor], biases: list[torch.Tensor | None], quant: str, device: torch.device,
              dtype: torch.dtype, parallel: str = "replicated") -> "Linear | None":
        """One linear over several weights with the same input (q|k|v, gate|up), or None.

        Each output is reduced on its own, so the fused outputs are bit-identical to separate calls;
        fusing saves kernel launches and thread fork/joins. Weights that would end up in different
        formats are not fused.
        """
        if len({r.shape[1] for r in raws}) != 1 or (any(b is None for b in biases) and any(b is not None for b in biases)):
            return None
        kinds = {cpu_format(r, quant) if device.type == "cpu" else "device" for r in raws}
        if len(kinds) != 1 or ("native" in kinds and len({r.qtype for r in raws}) != 1):
            return None
        n = sum(r.shape[0] for r in raws)
        if kinds == {"native"}:
            raw = RawTensor("fused", (n, raws[0].shape[1]), raws[0].qtype, torch.cat([r.raw_rows() for r in raws]).numpy())
        else:
            raw = RawTensor("fused", (n, raws[0].shape[1]), "torch", torch.cat([r.dequantize() for r in raws]))
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(raw, bias, quant, device, dtype, parallel)

    def select_rows(self, idx: torch.Tensor) -> "Linear":
        """This layer restricted to the output channels idx [n'] (int64): no re-quantization."""
        bias = None if self.bias is None else self.bias[idx.to(self.bias.device)].contiguous()
        w = self.weight
        rows = w[idx.to(w.device)].contiguous() if isinstance(w, torch.Tensor) else w.rows(idx)
        return Linear.of_weight(rows, bias, self.device, self.format, self.parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.device.type != "cpu":
            out = device_linear(x, self.weight, self.bias)
        else:
            out = ops.linear(x.contiguous(), self.weight, self.bias)
        return out if self.reduce_group is None else self.reduce_group.all_reduce(out)

    # A call goes straight to forward, past nn.Module's hook dispatch: the per-op path makes about
    # ten module calls per layer, and with the dispatch smollm2-135m's per-op forward took ~1.5 ms
    # more (decode_cost, README "The model as torch modules"). So forward hooks do not fire on the
    # model's modules; torch.compile and sharding take them as any module.
    __call__ = forward

    def nbytes(self) -> int:
        w = self.weight
        return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes

    def float_weight(self) -> torch.Tensor:
        """The weight as a float32 [out, in] tensor on its device (dequantized if packed)."""
        w = self.weight
        return (w if isinstance(w, torch.Tensor) else w.dequantize()).float()


def device_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  tile: int | None = None) -> torch.Tensor:  # [T, in] -> [T, out]
    """F.linear in fixed tiles of rows (CUDA_ROW_TILE): batch-invariant, each row's bits do not
    depend on the other rows of the step."""
    tile = CUDA_ROW_TILE if tile is None else tile
    t = x.shape[0]
    if not tile or t == 0:
        return F.linear(x, w, b)
    padded = -(-t // tile) * tile
    xp = F.pad(x, (0, 0, 0, padded - t)) if padded != t else x
    return torch.cat([F.linear(xp[i:i + tile], w, b) for i in range(0, padded, tile)])[:t]


def linears(module: nn.Module) -> list[Linear]:
    """The Linear modules under ``module`` (a layer, a model: its LM head included), in
    registration order."""
    return [m for m in module.modules() if isinstance(m, Linear)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> [T, H]; weight already includes Gemma's +1 offset."""
    if x.device.type == "cpu":
        return ops.rms_norm(x.contiguous(), weight, eps)
    return torch_rms_norm(x, weight, eps)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # (the CUDA path)
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


class Rope(nn.Module):
    """Half-split rotary embedding (HF's rotate_half layout) from a precomputed table."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, device: torch.device, scaling: float = 1.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        inv_freq = inv_freq / scaling
        pos = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_pos, D/2]
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

    def rows(self, positions3: torch.Tensor, section: tuple[int, ...]) -> "Rope":
        """M-RoPE (interleaved, Qwen3.5 / Qwen3-VL): a table with one row per token, frequency i
        taken at the token's h position when i % 3 == 1 and i < 3 * section[1], at its w position
        when i % 3 == 2 and i < 3 * section[2], else at its t position. positions3: [T, 3].
        A text token (t = h = w) gets exactly the 1-D table's row."""
        half = self.cos.shape[1]
        i = torch.arange(half)
        axis = torch.zeros(half, dtype=torch.int64)  # [D/2]: 0 t, 1 h, 2 w
        axis[(i % 3 == 1) & (i < 3 * section[1])] = 1
        axis[(i % 3 == 2) & (i < 3 * section[2])] = 2
        pos = positions3.long().to(self.cos.device)[:, axis.to(self.cos.device)]  # [T, D/2]
        col = i.to(self.cos.device).expand_as(pos)
        out = Rope.__new__(Rope)
        nn.Module.__init__(out)
        out.cos, out.sin = self.cos[pos, col].contiguous(), self.sin[pos, col].contiguous()  # [T, D/2]
        return out

    def for_batch(self, batch, section: tuple[int, ...]) -> tuple["Rope", torch.Tensor]:
        """The table and positions of a forward batch's rows (ForwardBatch.rope_positions): this
        table at batch.positions, at a 1-D rope_positions (text past an image: index + delta), or
        with images a per-row M-RoPE table (rows 0..T-1), built once per forward (batch.rope_table)."""
        if batch.rope_positions is None:
            return self, batch.positions
        if batch.rope_positions.dim() == 1:
            return self, batch.rope_positions
        if batch.rope_table is None:
            batch.rope_table = self.rows(batch.rope_positions, section)
        return batch.rope_table, torch.arange(batch.rope_positions.shape[0], dtype=torch.int32)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; positions: [T] -> rotated x (new tensor). A table narrower than D is
        partial rotary (Qwen3.5): the first dims of each head rotate, the rest pass.

        CPU: ops.rope (the C kernel the fused decoder path uses too, same bits as below)."""
        rd = 2 * self.cos.shape[1]
        if x.shape[-1] > rd:
            return torch.cat([self(x[..., :rd].contiguous(), positions), x[..., rd:]], dim=-1)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            return ops.rope(x, positions, self.cos, self.sin)
        return self.torch_rotate(x, positions)

    def torch_rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (the CUDA path)
        """x: [T, heads, D] with a table as wide as D -> rotated x."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    __call__ = forward  # (as Linear: no hook dispatch)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_ids: torch.Tensor, positions: torch.Tensor, scale: float, window: int,
                    softcap: float, kv_dtype: str = "fp32", k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None, max_position: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D] -> [T, Hq, D].

    kv_dtype / k_scales / v_scales: the cache's storage format (see models/kv_cache.py).
    max_position: positions.max() when the caller knows it (devices: saves a host sync)."""
    if q.device.type == "cpu":
        return ops.paged_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_ids, positions,
                                   scale, window, softcap, kv_dtype=kv_dtype, k_scales=k_scales,
                                   v_scales=v_scales)
    if kv_dtype not in ("fp32", "bf16", "fp16"):
        from specserve.errors import SpecserveError

        raise SpecserveError(f"--kv-cache-dtype {kv_dtype} is not supported on CUDA yet")
    return device_attention.paged_attention(q, k_cache, v_cache, block_tables, seq_ids, positions, scale, window,
                                            softcap, max_position)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up, gate / up: [T, N] -> [T, N]. CPU: ops.act_mul (shared with the fused path)."""
    if gate.device.type == "cpu" and gate.dtype == torch.float32:
        return ops.act_mul(gate, up, activation)
    return torch_act_mul(gate, up, activation)


def torch_act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:  # (the CUDA path)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def expert_order(chosen: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    """chosen [T, k] -> (the experts used, ascending; how many rows each; order [T*k]: the flat
    (row, slot) entries by expert, rows ascending within one), found with one stable sort, not a
    scan per expert."""
    flat = chosen.flatten()
    order = torch.sort(flat, stable=True).indices  # [T*k], by expert then by row
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return experts.tolist(), counts.tolist(), order


def route_top_k(logits: torch.Tensor, k: int, renormalise: bool):
    """:func:`top_k_experts` as (weight [T, k], groups), groups a list of (expert, rows, slot) in
    ascending expert order, rows ascending within one."""
    weight, chosen = top_k_experts(logits, k, renormalise)  # (torch: differentiable)
    experts, counts, order = expert_order(chosen)
    return weight, [(e, idx // k, idx % k) for e, idx in zip(experts, order.split(counts))]
