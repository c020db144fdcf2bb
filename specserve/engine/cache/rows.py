"""Per-sequence rows at consecutive positions, for drafters whose context is not paged.

DFlash and MTP keep, per sequence, a context of K/V rows (and MTP the target's hidden states) at
positions ``[start, end)``. Growing such a context with ``torch.cat`` copies all of it on every
step and on every draft token (megabytes per token at a 4K-token window). :class:`RowCache`
keeps the rows in buffers allocated ahead: appending copies only the new rows (a buffer doubles
when full), rolling back (a rejected draft, a recompute after preemption) and sliding a window
forward only move an index. Views of the live rows are contiguous, so the attention that reads
them sees exactly the tensors ``torch.cat`` would have built.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64  # rows allocated at first
CONTEXT_TRIM = 64  # a drafter's windowed context is trimmed in chunks of this many rows (dflash, MTP)


class RowCache:
    """Rows of several parts (a layer's K, its V, a hidden state...) at positions [start, end).

    ``parts()`` returns a view per part ([n, ...] each); the views are valid until the next
    append, which may move the rows."""

    def __init__(self):
        self.start = 0  # position of the first live row
        self._bufs: list[torch.Tensor] = []  # per part [capacity, ...]
        self._lo = 0  # buffer row of position start
        self._n = 0  # live rows

    def __len__(self) -> int:
        return self._n

    @property
    def end(self) -> int:
        return self.start + self._n

    def parts(self) -> list[torch.Tensor]:
        return [b[self._lo:self._lo + self._n] for b in self._bufs]

    def reset(self, start: int, parts: list[torch.Tensor] | None = None) -> None:
        """Forget every row; the rows of ``parts`` (if given) then sit at start, start + 1, ..."""
        self.start, self._lo, self._n = start, 0, 0
        if parts:
            self.append(parts)

    def append(self, parts: list[torch.Tensor]) -> None:
        """Add rows [m, ...] per part after the last one (positions end .. end + m - 1)."""
        m = parts[0].shape[0]
        if not self._bufs or [(b.shape[1:], b.dtype) for b in self._bufs] != [(p.shape[1:], p.dtype) for p in parts]:
            if self._n:
                raise ValueError("rows of another shape appended to a non-empty RowCache")
            self._bufs = [p.new_empty((max(MIN_CAPACITY, 2 * m), *p.shape[1:])) for p in parts]
            self._lo = 0
        if self._lo + self._n + m > self._bufs[0].shape[0]:
            self._make_room(m)
        for b, p in zip(self._bufs, parts):
            b[self._lo + self._n:self._lo + self._n + m] = p
        self._n += m

    def truncate(self, position: int) -> None:
        """Keep the rows before ``position`` (a rollback)."""
        self._n = min(self._n, max(position - self.start, 0))

    def drop_front(self, n: int) -> None:
        """Forget the first n rows (a window moving forward)."""
        n = min(n, self._n)
        self._lo, self._n, self.start = self._lo + n, self._n - n, self.start + n

    def _make_room(self, m: int) -> None:
        cap = self._bufs[0].shape[0]
        need = self._n + m
        new_cap = cap if need <= cap // 2 else max(2 * cap, need)  # shift down, or grow
        bufs = self._bufs if new_cap == cap else [b.new_empty((new_cap, *b.shape[1:])) for b in self._bufs]
        for old, new in zip(self._bufs, bufs):
            new[:self._n] = old[self._lo:self._lo + self._n].clone() if new is old else old[self._lo:self._lo + self._n]
        self._bufs, self._lo = bufs, 0
