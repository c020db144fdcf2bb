"""The integer-dot kernels' panel layout (csrc/panel_pack.c): int8 and GGUF weights are repacked at
construction, 16 channels' blocks side by side, and the file layout is dropped.

The packing must be a bijection (every raw byte comes back, for any bytes, any N), rows() and
dequantize() must read through it, and a call on the plain layout must give the bits of a call on
the packed one (the kernel packs plain weights per call: one arithmetic per format). The
arithmetic itself is checked against float64 references and across SIMD builds in test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from kernel_utils import raw_blocks

from specserve.kernels import ops

needs_c = pytest.mark.skipif(not ops.kernels_available(), reason="C kernels unavailable (no compiler?)")
pytestmark = needs_c

QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
SHAPES = [(1, 256), (16, 512), (37, 768), (50, 256)]  # N: one channel, one panel, odd, two panels + 2


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_packing_gives_every_byte_back(qtype, n, k):
    raw = raw_blocks(qtype, n, k, seed=n)
    w = ops.GGUFBlockWeight.from_raw(raw.clone(), qtype, n, k)
    assert w.packed is not None and w._raw is None  # the file layout is not kept twice
    _, be, bb = ops.GGUF_QTYPES[qtype]
    per_block = 148 if qtype == "Q4_K" else bb  # Q4_K's 6-bit scales and mins are kept as bytes
    assert w.packed.numel() == -(-n // 16) * 16 * (k // be) * per_block  # N padded to whole panels
    assert torch.equal(w.raw, raw)
    idx = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(w.rows(idx).raw, raw[idx])
    plain = ops.GGUFBlockWeight.from_raw(raw.clone(), qtype, n, k, int_dot=False)
    assert plain.packed is None
    assert torch.equal(w.dequantize(), plain.dequantize())


@pytest.mark.parametrize("qtype", QTYPES)
def test_plain_layout_call_gives_the_packed_bits(qtype):
    n, k = 37, 512
    w = ops.GGUFBlockWeight.from_raw(raw_blocks(qtype, n, k), qtype, n, k)
    x = torch.randn(5, k)
    bias = torch.randn(n)
    lib = ops._get_lib()
    plain = w.raw
    out = torch.empty(5, n)
    rc = lib.ss_linear_q8(x.data_ptr(), 5, k, k, plain.data_ptr(), w.fmt, w.row_bytes, None, bias.data_ptr(),
                          out.data_ptr(), n, n, 1)
    assert rc == 0
    assert torch.equal(out, ops.linear(x, w, bias))


@pytest.mark.parametrize("qtype", QTYPES)
def test_switching_to_fp32_activations_reads_the_file_layout(qtype):
    n, k = 37, 512
    raw = raw_blocks(qtype, n, k)
    w = ops.GGUFBlockWeight.from_raw(raw.clone(), qtype, n, k)
    x = torch.randn(3, k)
    w.int_dot = False  # what benchmarks do to time the other path
    y = ops.linear(x, w)
    ref = ops.linear(x, ops.GGUFBlockWeight.from_raw(raw.clone(), qtype, n, k, int_dot=False))
    assert torch.equal(y, ref)
    w.int_dot = True
    assert torch.equal(ops.linear(x, w), ops.linear(x, ops.GGUFBlockWeight.from_raw(raw.clone(), qtype, n, k)))


@pytest.mark.parametrize("n,k", [(1, 32), (37, 512), (50, 96)])
def test_int8_weights_pack_and_unpack(n, k):
    wf = torch.randn(n, k)
    w = ops.Int8Weight.from_float(wf)
    q = torch.round(wf / w.scale[:, None]).clamp(-127, 127).to(torch.int8)
    assert w.packed is not None and w._q is None
    assert torch.equal(w.q, q)
    idx = torch.tensor([n - 1, 0])
    assert torch.equal(w.rows(idx).q, q[idx])
    assert torch.equal(w.dequantize(), q.float() * w.scale[:, None])
    x = torch.randn(4, k)
    rows = torch.cat([ops.linear(x[i:i + 1], w) for i in range(4)])
    assert torch.equal(ops.linear(x, w), rows)


def test_int8_weights_without_whole_blocks_stay_plain():
    w = ops.Int8Weight.from_float(torch.randn(8, 40))  # K % 32 != 0: fp32 activations, no panels
    assert w.packed is None and w.act_block is None
    x = torch.randn(2, 40)
    ref = (x.double() @ (w.q.double() * w.scale.double()[:, None]).T).float()
    assert torch.allclose(ops.linear(x, w), ref, rtol=1e-5, atol=1e-5)


def test_packed_weights_under_the_torch_fallback():
    n, k = 20, 256
    w = ops.GGUFBlockWeight.from_raw(raw_blocks("Q4_K", n, k), "Q4_K", n, k)
    x = torch.randn(2, k)
    y_c, y_t = ops.linear(x, w), ops.linear(x, w, impl="torch")
    assert torch.allclose(y_c, y_t, rtol=1e-4, atol=1e-4 * y_t.abs().max().item())


def test_panel_entry_points_reject_bad_arguments():
    lib = ops._get_lib()
    assert lib.ss_panel_bytes(ops._FMT_F32, 16, 32) == 0  # fp32 has no panels
    assert lib.ss_panel_bytes(ops._FMT_Q4_K, 16, 300) == 0  # K not whole super-blocks
    w = ops.GGUFBlockWeight.from_raw(raw_blocks("Q8_0", 4, 64), "Q8_0", 4, 64)
    bad = torch.tensor([4], dtype=torch.int64)
    out = torch.empty(1, w.row_bytes, dtype=torch.uint8)
    assert lib.ss_panel_rows(w.fmt, w.packed.data_ptr(), 4, 64, bad.data_ptr(), 1, out.data_ptr()) != 0
    with pytest.raises(ValueError):
        w.rows(bad)
