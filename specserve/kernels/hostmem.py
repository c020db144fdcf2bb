"""Host memory for what every decode step streams: the packed weights.

Each buffer is a private anonymous mapping of its own, zero until written. One of 2 MiB or more
starts on a 2 MiB boundary and is advised ``MADV_HUGEPAGE``: where transparent huge pages are on
(``always`` or ``madvise`` in /sys/kernel/mm/transparent_hugepage/enabled) the OS backs it with
2 MiB pages. A decode step reads every weight once, front to back; with 4 KiB pages that is a TLB
miss every 4 KiB of the stream (benchmarks/host_pages.py times both; README "Huge pages"). Where
the OS has no huge pages to give, the same mapping gets 4 KiB pages: same bytes, same results.

Unmapped when the last tensor viewing it goes (the tensor holds the mapping).
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes: the x86-64 / arm64 transparent huge page size
_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)
_ANON = getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", None))
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def anon_bytes(n: int) -> torch.Tensor:
    """[n] uint8 zeros in a private anonymous mapping (2 MiB-aligned and advised huge pages when
    n >= 2 MiB); torch.zeros where the platform has no such mappings (Windows)."""
    if n <= 0 or _PRIVATE is None or _ANON is None:
        return torch.zeros(max(n, 0), dtype=torch.uint8)
    big = n >= HUGE_PAGE
    mm = mmap.mmap(-1, n + (HUGE_PAGE if big else 0), flags=_PRIVATE | _ANON)
    if big and _ADVICE is not None:
        try:
            mm.madvise(_ADVICE)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages
            pass
    base = torch.frombuffer(mm, dtype=torch.uint8)  # keeps mm alive
    off = (-base.data_ptr()) % HUGE_PAGE if big else 0
    return base[off:off + n]


def anon_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape`` in an ``anon_bytes`` mapping."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return anon_bytes(n).view(dtype).reshape(shape)


def gather_small(weights: list) -> int:
    """The packed tensors under 2 MiB of ``weights`` (objects with a ``packed`` uint8 tensor, or
    None) moved into one ``anon_bytes`` mapping, each at a 64-byte boundary, so that a model of
    small matrices streams huge pages too (a mapping of its own under 2 MiB gets 4 KiB pages).
    Returns the bytes moved. Same bytes: results do not change."""
    small, seen = [], set()
    for w in weights:
        t = getattr(w, "packed", None)
        if t is not None and id(w) not in seen and t.numel() < HUGE_PAGE and t.dtype == torch.uint8:
            seen.add(id(w))
            small.append(w)
    total = sum(-(-w.packed.numel() // 64) * 64 for w in small)
    if total < HUGE_PAGE:
        return 0
    buf, off = anon_bytes(total), 0
    for w in small:  # one at a time: each old buffer goes as soon as its bytes are copied
        n = w.packed.numel()
        buf[off:off + n].copy_(w.packed)
        w.packed = buf[off:off + n]
        off += -(-n // 64) * 64
    return total
