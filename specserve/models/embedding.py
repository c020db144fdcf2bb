"""Token embeddings that stay in their checkpoint blocks.

On CPU a GGUF block-quantized table (Q8_0 for smollm2 and gemma3, Q4_K for qwen2.5-coder-1.5b,
Q5_0 for qwen2.5-coder-0.5b) is kept as the file's blocks, and a lookup dequantizes only the rows it
asks for with the kernels' own dequantizer (``ops.dequantize_blocks``), which is bit for bit
gguf.quants' (tests/test_embedding.py). With tied
embeddings the blocks are the LM head's, kept in the kernels' panel layout: a lookup rebuilds its
rows' file blocks from the panels (``dequantize_rows``), so one copy serves both. gemma3-270m's 262,144 x 640 table is 680 bytes a row instead of 2,560 in
fp32; qwen2.5-coder-1.5b's 151,936 x 1,536 one is no second copy at all instead of 933 MB.
qwen2.5-coder-0.5b's Q5_0 table is 94 MB instead of 545 in fp32.
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
        self.qtype, self.hidden = raw.qtype, raw.shape[-1]
        self._head: ops.GGUFBlockWeight | None = None  # the tied LM head holding these blocks (CPU)
        self._rows: torch.Tensor | None = None  # [V, row_bytes] the file's blocks (CPU)
        self._table: torch.Tensor | None = None  # [V, H]
        if device.type != "cpu" or raw.qtype not in ops.DEQUANT_QTYPES or raw.row_perm is not None:
            self._table = raw.dequantize().to(device=device, dtype=dtype)
        elif isinstance(head_weight, ops.GGUFBlockWeight) and head_weight.qtype == raw.qtype \
                and head_weight.shape == tuple(raw.shape):
            self._head = head_weight
        else:
            self._rows = raw.raw_rows()
        self.shared = self._head is not None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self._table is not None:
            return self._table[ids]
        if self._head is not None:
            return self._head.dequantize_rows(ids).to(self.dtype)
        rows = self._rows[ids].contiguous()
        return ops.dequantize_blocks(rows, self.qtype, rows.shape[0], self.hidden).to(self.dtype)

    def table(self) -> torch.Tensor:
        """The whole table [V, H], dequantized (training reads it; a lookup never does)."""
        if self._table is not None:
            return self._table
        if self._head is not None:
            return self._head.dequantize().to(self.dtype)
        return ops.dequantize_blocks(self._rows, self.qtype, self._rows.shape[0], self.hidden).to(self.dtype)

    def nbytes(self) -> int:
        """Bytes this table adds to the weights (none when it shares the LM head's blocks)."""
        if self._table is not None:
            return self._table.numel() * self._table.element_size()
        return 0 if self.shared else self._rows.numel()
