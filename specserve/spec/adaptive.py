"""Adaptive draft length: choose each sequence's k from acceptance and measured cost.

Cost model: a forward pass over w tokens takes about a + b*w seconds (measured at start-up
and refit online). A sequence whose drafts are accepted with per-token probability p yields
on average 1 + p + ... + p^k tokens for k drafts. Starting from k = 0 everywhere, drafts
are added one at a time to the sequence with the best marginal gain p_i^(k_i+1), as long as
the batch's expected tokens per second still rises. On text where drafts are rarely
accepted this settles at k = 0, so speculation never makes decode slower by much.
"""

from __future__ import annotations

from collections import deque

from specserve.engine.sequence import Sequence

PROBE_EVERY = 8  # a sequence at k = 0 still drafts 1 token every so often, to keep learning


class CostModel:
    """Least-squares fit of forward time vs tokens in the forward, over recent steps."""

    def __init__(self, window: int = 256):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.a, self.b = 0.01, 0.001

    def add(self, width: int, seconds: float) -> None:
        self.samples.append((width, seconds))
        self._fit()

    def _fit(self) -> None:
        n = len(self.samples)
        if n < 2:
            return
        mx = sum(w for w, _ in self.samples) / n
        my = sum(t for _, t in self.samples) / n
        var = sum((w - mx) ** 2 for w, _ in self.samples)
        if var == 0:
            return
        b = sum((w - mx) * (t - my) for w, t in self.samples) / var
        self.b = max(b, 1e-7)
        self.a = max(my - self.b * mx, 1e-6)

    def time(self, width: int) -> float:
        return self.a + self.b * width


class DraftPolicy:
    def __init__(self, k_max: int, adaptive: bool, cost: CostModel, draft_cost_per_token: float = 0.0):
        self.k_max, self.adaptive, self.cost = k_max, adaptive, cost
        self.draft_cost = draft_cost_per_token
        self._step = 0

    def lengths(self, seqs: list[Sequence], limits: list[int], extra_width: int = 0) -> list[int]:
        """Draft length per sequence; limits[i] caps k (tokens left, context left)."""
        self._step += 1
        caps = [max(0, min(self.k_max, lim)) for lim in limits]
        if not self.adaptive:
            return caps
        ks = [0] * len(seqs)
        width = len(seqs) + extra_width
        tokens = float(len(seqs))
        best = tokens / self._time(width, ks)
        while True:
            gains = [(s.accept_ema ** (k + 1), i) for i, (s, k) in enumerate(zip(seqs, ks)) if k < caps[i]]
            if not gains:
                break
            gain, i = max(gains)
            ks[i] += 1
            rate = (tokens + gain) / self._time(width + 1, ks)
            if rate <= best:
                ks[i] -= 1
                break
            tokens, width, best = tokens + gain, width + 1, rate
        if self._step % PROBE_EVERY == 0:
            ks = [max(k, min(1, c)) for k, c in zip(ks, caps)]
        return ks

    def _time(self, width: int, ks: list[int]) -> float:
        return self.cost.time(width) + self.draft_cost * max(ks, default=0)

    @staticmethod
    def update(seq: Sequence, num_drafted: int, num_accepted: int, alpha: float = 0.3) -> None:
        """Fold one step's outcome into the sequence's acceptance estimate."""
        if num_drafted == 0:
            return
        tries = num_accepted + (1 if num_accepted < num_drafted else 0)
        seq.accept_ema = (1 - alpha) * seq.accept_ema + alpha * (num_accepted / tries)
