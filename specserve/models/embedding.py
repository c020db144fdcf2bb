"""Token embeddings that stay in their checkpoint blocks.

A Q8_0 embedding table (smollm2's, gemma3's) is kept as its GGUF bytes and a lookup dequantizes
only the rows it asks for: gemma3-270m's 262,144 x 640 table is 680 bytes a row instead of
2,560 in fp32 (671 MB less resident). The rows come out bit for bit as the whole-table
dequantization gave them (the f16 scale times the int8 value, in fp32, as gguf.quants does;
tests/test_golden.py holds the tokens). Other formats keep the dequantized table.
"""

from __future__ import annotations

import torch

from specserve.models.weights import RawTensor

Q8_0_BLOCK = 34  # bytes: f16 scale, 32 int8 values


class TokenEmbedding:
    def __init__(self, raw: RawTensor, device: torch.device, dtype: torch.dtype):
        self.dtype = dtype
        self.shape = raw.shape  # [V, H]
        self._values: torch.Tensor | None = None  # int8 [V, H / 32, 32] (Q8_0)
        self._scales: torch.Tensor | None = None  # fp32 [V, H / 32, 1]
        self._table: torch.Tensor | None = None  # [V, H]
        if raw.qtype == "Q8_0" and raw.row_perm is None:
            blocks = raw.raw_rows().view(raw.shape[0], -1, Q8_0_BLOCK)  # [V, H / 32, 34]
            self._scales = blocks[..., :2].contiguous().view(torch.float16).float().to(device)
            self._values = blocks[..., 2:].contiguous().view(torch.int8).to(device)
        else:
            self._table = raw.dequantize().to(device=device, dtype=dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self._table is not None:
            return self._table[ids]
        rows = self._values[ids].float() * self._scales[ids]  # [T, H / 32, 32]
        return rows.view(len(ids), self.shape[1]).to(self.dtype)

    def table(self) -> torch.Tensor:
        """The whole table [V, H] (training reads it; a lookup never does)."""
        if self._table is not None:
            return self._table
        return self(torch.arange(self.shape[0], device=self._values.device))

    def nbytes(self) -> int:
        held = [self._table] if self._table is not None else [self._values, self._scales]
        return sum(t.numel() * t.element_size() for t in held)
