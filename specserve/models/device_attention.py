"""Paged attention in torch for devices without our C kernels (CUDA), batch-invariant.

Speculative decoding is lossless only if a row verified among k others gets the bits it would get
alone. A matmul over a [rows, keys] grid does not promise that: the library picks its kernel, and
with it the order of each sum, by the shapes, and the shapes change with the step's rows and the
longest context among them. So here every sum has a shape of its own row's making:

* a score is an element-wise product summed over the head dimension (one fixed-size sum per
  score);
* softmax's maximum is exact in any order; the exponentials and the value-weighted rows are summed
  in chunks of ``KEY_CHUNK`` keys (fixed-size sums), and the chunks are added one after another in
  key order. Keys past a row's position weigh exactly 0, so the extra chunks another row's
  longer context brings add exact zeros after the row's own.

The rows are processed in groups sized by memory only (every operation is per row). Slower than
one matmul, which matters little at decode widths: the weights' stream dominates there.
"""

from __future__ import annotations

import torch

KEY_CHUNK = 256  # keys per fixed-size partial sum
GROUP_BYTES = 256 << 20  # the largest [rows, heads, keys, D] float32 product built at once


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_ids: torch.Tensor, positions: torch.Tensor, scale: float, window: int,
                    softcap: float, max_position: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [S, nb];
    seq_ids / positions: [T] -> [T, Hq, D] in q's dtype. max_position: positions.max() if the
    caller has it on the host (one sync per forward instead of one per layer)."""
    t_len, hq, d = q.shape
    if t_len == 0:
        return q.clone()
    top = int(positions.max()) if max_position is None else max_position
    keys = -(-(top + 1) // KEY_CHUNK) * KEY_CHUNK  # [0, keys) covers every row's context
    rows = max(1, GROUP_BYTES // (hq * keys * d * 4))
    out = [_rows(q[i:i + rows], k_cache, v_cache, block_tables, seq_ids[i:i + rows], positions[i:i + rows],
                 keys, scale, window, softcap) for i in range(0, t_len, rows)]
    return torch.cat(out).to(q.dtype)


def _gather(cache: torch.Tensor, tables: torch.Tensor, keys: int, rep: int) -> torch.Tensor:
    """Each row's first `keys` cached rows, heads repeated for grouped queries:
    cache [blocks, bs, Hkv, D], tables [G, nb] -> [G, Hq, keys, D] float32."""
    g, bs = tables.shape[0], cache.shape[1]
    nb = -(-keys // bs)
    if tables.shape[1] < nb:  # the table is shorter than the chunked length: pad with block 0 (masked)
        tables = torch.nn.functional.pad(tables, (0, nb - tables.shape[1]))
    x = cache[tables[:, :nb]].reshape(g, nb * bs, cache.shape[2], cache.shape[3])[:, :keys]
    return x.float().repeat_interleave(rep, dim=2).transpose(1, 2).contiguous()


def _rows(q, k_cache, v_cache, block_tables, seq_ids, positions, keys: int, scale: float, window: int,
          softcap: float) -> torch.Tensor:  # q: [G, Hq, D] -> [G, Hq, D] float32
    g, hq, d = q.shape
    rep = hq // k_cache.shape[2]
    tables = block_tables[seq_ids.long()].long()  # [G, nb]
    k = _gather(k_cache, tables, keys, rep)  # [G, Hq, L, D]
    scores = (q.float()[:, :, None, :] * k).sum(-1) * scale  # [G, Hq, L]: one sum over D per score
    del k
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = positions.long()[:, None]  # [G, 1]
    kpos = torch.arange(keys, device=q.device)[None, :]  # [1, L]
    mask = kpos <= pos
    if window:
        mask &= (pos - kpos) < window
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)  # exact in any order
    weights = torch.exp(scores - top)  # [G, Hq, L], exactly 0 outside the row's keys
    chunks = keys // KEY_CHUNK
    denom = _in_key_order(weights.view(g, hq, chunks, KEY_CHUNK).sum(-1))  # [G, Hq]
    v = _gather(v_cache, tables, keys, rep).transpose(2, 3).contiguous()  # [G, Hq, D, L]
    num = (weights[:, :, None, :] * v).view(g, hq, d, chunks, KEY_CHUNK).sum(-1)  # [G, Hq, D, chunks]
    return _in_key_order(num) / denom[..., None]


def _in_key_order(parts: torch.Tensor) -> torch.Tensor:  # [..., chunks] -> [...]: added first to last
    total = parts[..., 0].clone()
    for c in range(1, parts.shape[-1]):
        total += parts[..., c]
    return total
