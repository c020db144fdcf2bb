"""models/embedding.py: Q8_0 rows dequantized at lookup equal the whole-table dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from specserve.models.embedding import TokenEmbedding
from specserve.models.weights import RawTensor


def test_q8_0_rows_at_lookup_equal_the_dequantized_table():
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((300, 96)) * 0.1).astype(np.float32)
    blocks = gguf.quants.quantize(table, gguf.GGMLQuantizationType.Q8_0)  # uint8 [300, 102]
    raw = RawTensor("embed", (300, 96), "Q8_0", blocks)
    emb = TokenEmbedding(raw, torch.device("cpu"), torch.float32)
    want = raw.dequantize()
    ids = torch.tensor([0, 299, 7, 7, 150])
    assert torch.equal(emb(ids), want[ids])
    assert torch.equal(emb.table(), want)
    assert emb.nbytes() < want.numel() * 4 / 3  # int8 values and one fp32 scale per 32
    f32 = TokenEmbedding(RawTensor("embed", (300, 96), "F32", table), torch.device("cpu"), torch.float32)
    assert torch.equal(f32(ids), torch.from_numpy(table)[ids])
