"""What the kernel test modules share: whether the C kernels are built, the row counts and
implementations they sweep, a thread-count setter for torch and the C kernels together, and random
GGUF block bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.kernels import ops

HAVE_C = ops.kernels_available()
needs_c = pytest.mark.skipif(not HAVE_C, reason="C kernels unavailable (no compiler?)")

ROW_COUNTS = (1, 2, 3, 7, 8, 9, 12, 16, 17, 64)
IMPLS = [pytest.param("c", marks=needs_c), "torch"]


def set_threads(n: int | None) -> None:
    """torch's and the C kernels' thread counts (None: the kernels' default)."""
    torch.set_num_threads(n if n is not None else torch.get_num_threads())
    ops.set_num_threads(n)


def attention_case(D=64, Hq=6, Hkv=2, BS=16, lengths=(37, 70), seed=0, score_scale=1.0):
    """Two sequences sharing one block pool with scattered block ids.
    Every position of each sequence has a query (prefill-like)."""
    g = torch.Generator().manual_seed(seed)
    nblocks_needed = [(L + BS - 1) // BS for L in lengths]
    NB = sum(nblocks_needed) + 5
    perm = torch.randperm(NB, generator=g).to(torch.int32)
    maxb = max(nblocks_needed) + 1
    bt = torch.full((len(lengths), maxb), -1, dtype=torch.int32)  # unused entries invalid
    o = 0
    for s, nb in enumerate(nblocks_needed):
        bt[s, :nb] = perm[o:o + nb]
        o += nb
    kc = torch.randn(NB, BS, Hkv, D, generator=g) * score_scale
    vc = torch.randn(NB, BS, Hkv, D, generator=g)
    sid = torch.cat([torch.full((L,), s, dtype=torch.int32) for s, L in enumerate(lengths)])
    pos = torch.cat([torch.arange(L, dtype=torch.int32) for L in lengths])
    q = torch.randn(len(sid), Hq, D, generator=g)
    return q, kc, vc, bt, sid, pos


def raw_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random bytes in qtype's layout whose f16 scales are small and finite."""
    _, be, bb = ops.GGUF_QTYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // be, bb), dtype=np.uint8)
    d = (rng.standard_normal((n, k // be, 2)) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, k // be, 4)
    if qtype == "Q6_K":
        raw[..., 208:210] = d[..., :2]
    elif qtype in ("Q4_1", "Q4_K"):
        raw[..., 0:4] = d
    else:
        raw[..., 0:2] = d[..., :2]
    return torch.from_numpy(raw.reshape(n, -1))
