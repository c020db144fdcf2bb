"""Verification of draft tokens against the target, in the terms of the papers.

One target forward runs over ``[last, d_1 .. d_k]`` (the last committed token followed by k
draft tokens) and yields k + 1 distributions: row j predicts the token after d_j.

* **accepted tokens**: the leading draft tokens the target agrees with.
* **recovered token**: at the first rejected position j, the token the target puts there
  instead (its argmax at temperature 0; a sample from norm(max(p - q, 0)) otherwise).
* **bonus token**: when all k drafts are accepted, one more token from row k, for free.

So every step yields accepted + 1 tokens. At temperature 0 the result is exactly the
target's greedy continuation; at temperature > 0 rejection sampling (Leviathan et al.
2023, Chen et al. 2023) keeps the target's distribution exactly. A drafter that gives no
probabilities (n-gram) is a point mass: q(d_j) = 1.

A seeded request is verified by its positions' noise instead (``verify_keyed``): the target's
token at each position is the sample its noise picks (engine/sampler.py, PositionNoise), and a
draft is accepted where it is that token. Every token is then an exact sample of the target's
distribution, and the same one with or without speculation, whatever was drafted.
"""

from __future__ import annotations

import torch

from specserve.engine.sampler import PositionNoise, sample_at, sample_from
from specserve.kernels.ops import argmax_rows


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, list[int]]:
    """target_logits: [k + 1, V] (penalized) -> (num accepted, accepted + recovered/bonus token)."""
    argmax = argmax_rows(target_logits)  # [k + 1]
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return n, list(drafts[:n]) + [argmax[n]]


def verify_sampling(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                    generator: torch.Generator | None) -> tuple[int, list[int]]:
    """target_probs: [k + 1, V]; draft_probs: [k, V] or None (point masses).

    Returns (num accepted, accepted tokens + recovered or bonus token).
    """
    for j, d in enumerate(drafts):
        p = target_probs[j, d].item()
        q = draft_probs[j, d].item() if draft_probs is not None else 1.0
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if q > 0 and u < min(1.0, p / q):
            continue
        return j, list(drafts[:j]) + [_recover(target_probs[j], draft_probs, j, d, generator)]
    k = len(drafts)
    return k, list(drafts) + [sample_from(target_probs[k], generator)]


def verify_keyed(target_probs: torch.Tensor, drafts: list[int], noise: PositionNoise,
                 first: int) -> tuple[int, list[int]]:
    """target_probs: [k + 1, V]; row j samples output position ``first + j`` with that position's
    noise. Returns (num accepted, accepted tokens + the first sample that differs, or the bonus)."""
    width = target_probs.shape[-1]
    for j, d in enumerate(drafts):
        tok = sample_at(target_probs[j], noise.at(first + j, width))
        if tok != d:
            return j, list(drafts[:j]) + [tok]
    k = len(drafts)
    return k, list(drafts) + [sample_at(target_probs[k], noise.at(first + k, width))]


def _recover(p: torch.Tensor, draft_probs: torch.Tensor | None, j: int, d: int,
             generator: torch.Generator | None) -> int:
    """Sample from norm(max(p - q, 0)); q is a point mass on d without draft probabilities."""
    if draft_probs is None:
        residual = p.clone()
        residual[d] = 0.0
    else:
        residual = (p - draft_probs[j]).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q: any sample from p is exact
        return sample_from(p, generator)
    return sample_from(residual / total, generator)
