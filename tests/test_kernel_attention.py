"""Tests of the batch-invariant paged attention kernels (CPU C kernels, the torch fallback, and the
CUDA path's device attention and row-tiled linear run on the CPU): against a float64 dense
reference, bit for bit across groupings of queries, builds and thread counts, and their index
checks."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import IMPLS, attention_case, needs_c, set_threads
from specserve.kernels import ops

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: single-threaded unless a test compares


# --------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------


def _dense_reference(q, kc, vc, bt, sid, pos, scale, window=0, softcap=0.0):
    """float64 attention per sequence on the gathered (dense) keys/values."""
    T, Hq, D = q.shape
    _, BS, Hkv, _ = kc.shape
    group = Hq // Hkv
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    for s in sid.unique().tolist():
        idx = (sid == s).nonzero().flatten()
        qpos = pos[idx].long()
        kp = torch.arange(int(qpos.max()) + 1)
        blocks = bt[s].long()[kp // BS]
        k = kc[blocks, kp % BS].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = vc[blocks, kp % BS].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->thl", q[idx].double(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        masked = kp[None, :] > qpos[:, None]
        if window > 0:
            masked |= kp[None, :] <= qpos[:, None] - window
        scores = scores.masked_fill(masked[:, None, :], float("-inf"))
        out[idx] = torch.einsum("thl,lhd->thd", torch.softmax(scores, -1), v)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "D,Hq,Hkv,window,cap",
    [(64, 6, 2, 0, 0.0), (128, 4, 4, 0, 0.0), (256, 8, 4, 0, 0.0), (64, 6, 3, 9, 0.0),
     (36, 4, 1, 0, 5.0), (64, 4, 2, 17, 20.0), (32, 130, 1, 0, 0.0)],  # 130 heads per kv head: 3 items
)
def test_paged_attention_matches_dense(impl, D, Hq, Hkv, window, cap):
    q, kc, vc, bt, sid, pos = attention_case(D=D, Hq=Hq, Hkv=Hkv, score_scale=3.0 if cap else 1.0)
    scale = D ** -0.5
    out = ops.paged_attention(q, kc, vc, bt, sid, pos, scale, window, cap, impl=impl)
    ref = _dense_reference(q, kc, vc, bt, sid, pos, scale, window, cap)
    assert out.shape == q.shape
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("D,Hq,Hkv,window,cap", [(64, 6, 2, 0, 0.0), (64, 6, 3, 9, 0.0), (64, 4, 2, 17, 20.0)])
def test_device_paged_attention_matches_dense_and_is_batch_invariant(D, Hq, Hkv, window, cap):
    """The CUDA path's torch attention (run here on CPU tensors): prefill runs, single decode
    rows, and rows of one sequence split into several runs all match the dense reference, and
    every row gets the bits it gets alone, whatever else is in the step."""
    from specserve.models import device_attention

    def run(idx, max_position=None):
        return device_attention.paged_attention(q[idx], kc, vc, bt, sid[idx], pos[idx], scale, window, cap,
                                                max_position)

    q, kc, vc, bt, sid, pos = attention_case(D=D, Hq=Hq, Hkv=Hkv, score_scale=3.0 if cap else 1.0)
    scale = D ** -0.5
    ref = _dense_reference(q, kc, vc, bt, sid, pos, scale, window, cap)
    everything = torch.arange(q.shape[0])
    out = run(everything)
    assert out.shape == q.shape and (out.double() - ref).abs().max() < 1e-5
    idx = torch.tensor([40, 3, 41, 100, 5, 36, 106])  # interleaved sequences, mixed positions
    assert torch.equal(run(idx), out[idx])
    for i in (0, 3, 40, 106):  # alone, and as the only short row beside the longest context
        assert torch.equal(run(torch.tensor([i]))[0], out[i])
        assert torch.equal(run(torch.tensor([i, int(pos.argmax())]))[0], out[i])
        # the forward's largest position given by the caller (read once per forward, not per layer),
        # here far past this row's, so its keys span 3 chunks of 256 where its own span one
        assert torch.equal(run(torch.tensor([i]), max_position=int(pos.max()) + 600)[0], out[i])


def test_device_linear_rows_do_not_depend_on_the_other_rows():
    from specserve.models.layers import device_linear

    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 80, generator=g), torch.randn(96, generator=g), torch.randn(150, 80, generator=g)
    out = device_linear(x, w, b, tile=64)
    assert out.shape == (150, 96) and torch.allclose(out, torch.nn.functional.linear(x, w, b), atol=1e-4)
    for rows in (slice(0, 1), slice(3, 11), slice(60, 130), slice(149, 150)):
        assert torch.equal(device_linear(x[rows], w, b, tile=64), out[rows])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("D,Hq,Hkv,cap", [(64, 6, 2, 0.0), (36, 4, 1, 5.0), (100, 8, 2, 0.0), (128, 4, 4, 0.0),
                                         (32, 130, 1, 0.0)])
@pytest.mark.parametrize("window", [0, 9])
def test_paged_attention_grouping_invariance(impl, D, Hq, Hkv, cap, window):
    """Prefill-like runs (rows of one sequence share each K / V row between them and the group's
    heads in the C kernel; with a window, rows at consecutive positions) give every row the bits
    it gets alone or in any other batch."""
    q, kc, vc, bt, sid, pos = attention_case(D=D, Hq=Hq, Hkv=Hkv, lengths=(29, 45), score_scale=3.0 if cap else 1.0)
    T = q.shape[0]
    args = dict(scale=D ** -0.5, sliding_window=window, softcap=cap, impl=impl)
    full = ops.paged_attention(q, kc, vc, bt, sid, pos, **args)
    # one query at a time (decode-like)
    for t in range(T):
        one = ops.paged_attention(q[t:t + 1], kc, vc, bt, sid[t:t + 1], pos[t:t + 1], **args)
        assert torch.equal(one[0], full[t]), t
    # random groupings / orders (verification blocks of mixed sequences)
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(T, generator=g)
    for size in (3, 8, 17):
        for i in range(0, T, size):
            idx = perm[i:i + size]
            part = ops.paged_attention(q[idx].contiguous(), kc, vc, bt, sid[idx].contiguous(),
                                       pos[idx].contiguous(), **args)
            assert torch.equal(part, full[idx])


@needs_c
@pytest.mark.parametrize("variant", ["c-avx2", "c-scalar"])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 8, 2), (100, 6, 3), (36, 4, 4), (64, 9, 3)])
def test_paged_attention_same_bits_in_every_build(variant, D, Hq, Hkv):
    """The AVX-512 (two query vectors per register, odd counts padded), AVX2 and scalar attention
    give the same bits on prefill-like runs (several rows of a sequence per work item) and single
    rows."""
    try:
        ops._select(variant)
    except ops.KernelError as e:
        pytest.skip(str(e))
    q, kc, vc, bt, sid, pos = attention_case(D=D, Hq=Hq, Hkv=Hkv, lengths=(29, 75), score_scale=3.0)
    for window, cap in ((0, 0.0), (0, 20.0), (17, 0.0)):
        native = ops.paged_attention(q, kc, vc, bt, sid, pos, D ** -0.5, window, cap, impl="c")
        other = ops.paged_attention(q, kc, vc, bt, sid, pos, D ** -0.5, window, cap, impl=variant)
        assert torch.equal(native, other), (window, cap)


@needs_c
def test_paged_attention_thread_invariance():
    q, kc, vc, bt, sid, pos = attention_case(D=128, Hq=4, Hkv=2, lengths=(50, 33))
    set_threads(2)
    a = ops.paged_attention(q, kc, vc, bt, sid, pos, 0.1, 16, 0.0, impl="c")
    set_threads(1)
    b = ops.paged_attention(q, kc, vc, bt, sid, pos, 0.1, 16, 0.0, impl="c")
    assert torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_paged_attention_index_errors(impl):
    q, kc, vc, bt, sid, pos = attention_case(D=32, Hq=2, Hkv=1, lengths=(20,))
    bad = bt.clone()
    bad[0, 0] = kc.shape[0]  # block id out of range
    with pytest.raises(IndexError):
        ops.paged_attention(q, kc, vc, bad, sid, pos, 0.1, impl=impl)
    bad_pos = pos.clone()
    bad_pos[-1] = bt.shape[1] * kc.shape[1]  # beyond the block table
    with pytest.raises(IndexError):
        ops.paged_attention(q, kc, vc, bt, sid, bad_pos, 0.1, impl=impl)
    with pytest.raises(IndexError):
        ops.paged_attention(q, kc, vc, bt, sid + 1, pos, 0.1, impl=impl)
    with pytest.raises(ValueError):
        ops.paged_attention(q, kc, vc, bt, sid.long(), pos, 0.1, impl=impl)
    with pytest.raises(ValueError):
        ops.paged_attention(q[:, :, :16].contiguous(), kc, vc, bt, sid, pos, 0.1, impl=impl)


@needs_c
@pytest.mark.parametrize("window", [0, 300])
def test_rows_over_several_fp32_tiles_keep_their_bits(window):
    """An fp32 cache is read in tiles of ATT_F32_TILE_BYTES of its rows (256 keys at D = 256): a
    verification of 8 rows 700 keys deep (6 blocks of query vectors over every tile, a window
    crossing tile edges) matches the dense reference, and every row gets the bits it gets alone, on
    2 threads, under either prefetch hint, and in the AVX2 and scalar builds."""
    q, kc, vc, bt, sid, pos = attention_case(D=256, Hq=8, Hkv=2, lengths=(700, 45))
    rows = torch.arange(692, 700)  # the last 8 positions of the long sequence
    args = (kc, vc, bt, sid[rows], pos[rows], 256 ** -0.5, window, 0.0)
    out = ops.paged_attention(q[rows], *args, impl="c")
    ref = _dense_reference(q[rows], kc, vc, bt, sid[rows], pos[rows], 256 ** -0.5, window)
    assert (out.double() - ref).abs().max() < 1e-5
    for i in range(len(rows)):
        one = ops.paged_attention(q[rows[i:i + 1]], kc, vc, bt, sid[rows[i:i + 1]], pos[rows[i:i + 1]],
                                  256 ** -0.5, window, 0.0, impl="c")
        assert torch.equal(one[0], out[i]), i
    set_threads(2)
    try:
        assert torch.equal(ops.paged_attention(q[rows], *args, impl="c"), out)
    finally:
        set_threads(1)
    from specserve.kernels import library

    try:  # the prefetch hint's run-time switch (prefetcht0 for the cache's rows too) moves no bits
        assert library.set_prefetch_t0(True) and library.prefetch_t0() is True
        assert torch.equal(ops.paged_attention(q[rows], *args, impl="c"), out)
    finally:
        library.set_prefetch_t0(False)
    for variant in ("c-avx2", "c-scalar"):
        try:
            ops._select(variant)
        except ops.KernelError:
            continue
        assert torch.equal(ops.paged_attention(q[rows], *args, impl=variant), out), variant
