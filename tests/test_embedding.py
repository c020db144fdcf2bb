"""models/embedding.py: GGUF rows dequantized at lookup equal the whole-table dequantization,
and a tied LM head's blocks serve as the table."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specserve.kernels import ops
from specserve.models.embedding import TokenEmbedding
from specserve.models.weights import RawTensor

CPU = torch.device("cpu")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_rows_at_lookup_equal_the_dequantized_table(qtype):
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((300, 96)) * 0.1).astype(np.float32)
    blocks = gguf.quants.quantize(table, gguf.GGMLQuantizationType[qtype])
    raw = RawTensor("embed", (300, 96), qtype, blocks)
    emb = TokenEmbedding(raw, CPU, torch.float32)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).reshape(300, 96))
    ids = torch.tensor([0, 299, 7, 7, 150])
    assert torch.equal(emb(ids), want[ids])
    assert torch.equal(emb.table(), want)
    assert not emb.shared and emb.nbytes() < want.numel() * 4 / 3  # blocks, not fp32
    ops.set_default_impl("torch")  # the fallback reads the same blocks
    try:
        assert torch.equal(emb(ids), want[ids])
    finally:
        ops.set_default_impl(None)
    if qtype not in ops.GGUF_QTYPES:  # Q5_0 / Q5_1: no linear keeps them as blocks
        return
    head = ops.GGUFBlockWeight.from_raw(raw.raw_rows(), qtype, 300, 96)
    tied = TokenEmbedding(raw, CPU, torch.float32, head_weight=head)
    assert tied.shared and tied.nbytes() == 0 and torch.equal(tied(ids), want[ids])


def test_a_float_table_stays_a_table():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    emb = TokenEmbedding(RawTensor("embed", (4, 3), "F32", table), CPU, torch.float32)
    assert not emb.shared and torch.equal(emb(torch.tensor([3, 1])), torch.from_numpy(table)[[3, 1]])
