"""Packed weights in their own private mappings, advised huge pages (kernels/hostmem.py)."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from specserve.kernels.hostmem import HUGE_PAGE, anon_bytes, anon_zeros

linux = pytest.mark.skipif(not (os.path.exists("/proc/self/smaps") and hasattr(mmap, "MADV_HUGEPAGE")
                                and os.path.isdir("/sys/kernel/mm/transparent_hugepage")),
                           reason="needs Linux /proc and a kernel with transparent huge pages")


def mapping_of(addr: int) -> dict | None:
    """The /proc/self/smaps entry holding addr: {'perms': 'rw-p', 'flags': [...]}, or None."""
    found, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
                if inside:
                    found = {"perms": head[1], "flags": []}
            elif inside and head[0] == "VmFlags:":
                found["flags"] = head[1:]
    return found


def test_anon_bytes_are_zero_writable_and_aligned():
    t = anon_bytes(3 * HUGE_PAGE + 123)
    assert t.dtype == torch.uint8 and t.shape == (3 * HUGE_PAGE + 123,) and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t[-1] = 7
    t[0] = 1
    assert int(t.sum()) == 8
    small = anon_bytes(1000)
    assert small.shape == (1000,) and not small.any() and small.data_ptr() % 64 == 0
    assert anon_bytes(0).shape == (0,)
    z = anon_zeros((4, 3, 5), torch.float32)
    assert z.shape == (4, 3, 5) and z.dtype == torch.float32 and not z.any()


@linux
def test_large_buffers_are_private_and_advised_huge_pages():
    t = anon_bytes(4 * HUGE_PAGE)
    t.fill_(1)
    m = mapping_of(t.data_ptr())
    assert m is not None
    assert m["perms"].endswith("p")  # private: not shared memory, whose huge pages another setting governs
    assert "hg" in m["flags"]  # MADV_HUGEPAGE
    small = anon_bytes(64 << 10)
    assert "hg" not in mapping_of(small.data_ptr())["flags"]


@linux
def test_mapping_goes_with_the_last_view():
    t = anon_bytes(2 * HUGE_PAGE)
    view = t[HUGE_PAGE:]
    addr = t.data_ptr()
    del t
    gc.collect()
    assert mapping_of(addr) is not None  # the view keeps it
    del view
    gc.collect()
    assert mapping_of(addr) is None


@linux
def test_packed_weights_live_in_huge_page_mappings():
    from specserve.kernels.linear import linear
    from specserve.kernels.tune import random_block_weight

    w = random_block_weight("Q4_K", 4096, 1536)  # 3.5 MB packed
    if w.packed is None:
        pytest.skip("no C kernels: weights stay in the file layout")
    assert w.packed.data_ptr() % HUGE_PAGE == 0
    assert "hg" in mapping_of(w.packed.data_ptr())["flags"]
    x = torch.randn(3, 1536)
    y = linear(x, w)
    w.packed = w.packed.clone()  # the same bytes in torch's own allocation
    assert torch.equal(linear(x, w), y)


def test_gather_small_moves_small_packed_tensors_into_one_mapping():
    from specserve.kernels.hostmem import gather_small

    class W:
        def __init__(self, n: int):
            self.packed = torch.randint(0, 256, (n,), dtype=torch.uint8)

    ws = [W(700_000 + 64 * i) for i in range(6)] + [W(3 * HUGE_PAGE), W(100)]
    ws.append(ws[0])  # a tied weight listed twice moves once
    before = [w.packed.clone() for w in ws]
    moved = gather_small(ws)
    small = ws[:6] + [ws[7]]
    assert moved == sum(-(-w.packed.numel() // 64) * 64 for w in small)
    assert all(torch.equal(w.packed, b) for w, b in zip(ws, before))
    ptrs = sorted(w.packed.data_ptr() for w in small)
    assert ptrs[0] % HUGE_PAGE == 0 and all(p % 64 == 0 for p in ptrs)
    assert ptrs[-1] - ptrs[0] < moved  # side by side in one buffer
    assert ws[6].packed.numel() == 3 * HUGE_PAGE and ws[6].packed.data_ptr() not in ptrs  # large ones stay
    assert gather_small([W(1000), W(2000)]) == 0  # too little to fill a huge page: left alone


@linux
def test_a_loaded_model_streams_only_advised_mappings():
    from specserve.models.layers import linears
    from specserve.models.loader import LoadOptions, load_model

    lm = load_model("smollm2-135m", LoadOptions("cpu", "auto", "auto"))
    packed = [lin.weight.packed for lin in linears(lm.model) if getattr(lin.weight, "packed", None) is not None]
    if not packed:
        pytest.skip("no C kernels: weights stay in the file layout")
    assert all("hg" in mapping_of(t.data_ptr())["flags"] for t in packed)
