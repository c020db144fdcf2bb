"""Token embeddings that stay in their checkpoint blocks.

On CPU a GGUF block-quantized table (Q8_0 for smollm2 and gemma3, Q4_K for qwen2.5) is kept as
its blocks (``ops.GGUFBlockWeight``), and a lookup dequantizes only the rows it asks for with the
kernels' own dequantizer, which is bit for bit gguf.quants' (tests/test_embedding.py). With tied
embeddings the blocks are the LM head's, kept in the kernels' panel layout: a lookup rebuilds its
rows' file blocks from the panels (``dequantize_rows``), so one copy serves both. gemma3-270m's 262,144 x 640 table is 680 bytes a row instead of 2,560 in
fp32; qwen2.5-coder-1.5b's 151,936 x 1,536 one is no second copy at all instead of 933 MB.
A Q5_0 / Q5_1 table (qwen2.5-coder-0.5b's), which no linear layer uses as blocks, is kept as its
file rows, dequantized by the same kernels at lookup: 94 MB instead of 545 in fp32.
A float table, or a table on another device, is kept dequantized.
"""

from __future__ import annotations

import torch

from specserve.kernels import ops
from specserve.models.weights import RawTensor


class TokenEmbedding:
    def __init__(self, raw: RawTensor, device: torch.device, dtype: torch.dtype,
                 head_weight: object | None = None):
        """``head_weight``: the tied LM head's weight, reused when it holds these very blocks."""
        self.dtype = dtype
        self._blocks: ops.GGUFBlockWeight | None = None  # [V, H] in GGUF blocks (CPU)
        self._table: torch.Tensor | None = None  # [V, H]
        self._rows: torch.Tensor | None = None  # [V, row_bytes] file blocks of a type no linear uses (Q5_0)
        self.qtype, self.hidden = raw.qtype, raw.shape[-1]
        if device.type == "cpu" and raw.qtype in ops.DEQUANT_QTYPES and raw.qtype not in ops.GGUF_QTYPES \
                and raw.row_perm is None:
            self._rows = raw.raw_rows()
        elif device.type != "cpu" or raw.qtype not in ops.GGUF_QTYPES or raw.row_perm is not None:
            self._table = raw.dequantize().to(device=device, dtype=dtype)
        elif isinstance(head_weight, ops.GGUFBlockWeight) and head_weight.qtype == raw.qtype \
                and head_weight.shape == tuple(raw.shape):
            self._blocks = head_weight
        else:
            self._blocks = ops.GGUFBlockWeight.from_raw(raw.raw_rows(), raw.qtype, *raw.shape, int_dot=False)
        self.shared = self._blocks is not None and self._blocks is head_weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self._table is not None:
            return self._table[ids]
        if self._rows is not None:
            return self._dequantize(self._rows[ids].contiguous())
        return self._blocks.dequantize_rows(ids).to(self.dtype)

    def table(self) -> torch.Tensor:
        """The whole table [V, H], dequantized (training reads it; a lookup never does)."""
        if self._rows is not None:
            return self._dequantize(self._rows)
        return self._table if self._table is not None else self._blocks.dequantize().to(self.dtype)

    def _dequantize(self, rows: torch.Tensor) -> torch.Tensor:  # [n, row_bytes] -> [n, H]
        out = ops.dequantize_blocks(rows, self.qtype, rows.shape[0], self.hidden)
        if out is None:  # the torch fallback
            import gguf

            arr = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[self.qtype])
            out = torch.from_numpy(arr.astype("float32").reshape(rows.shape[0], self.hidden))
        return out.to(self.dtype)

    def nbytes(self) -> int:
        """Bytes this table adds to the weights (none when it shares the LM head's blocks)."""
        if self._table is not None:
            return self._table.numel() * self._table.element_size()
        if self._rows is not None:
            return self._rows.numel()
        return 0 if self.shared else self._blocks.nbytes
