"""Logit processing (logit_bias, penalties, temperature, top-k/top-p/min-p) and sampling.

All functions work on the rows of one sequence. Row j of a verification block is the
distribution after the sequence's tokens plus the first j draft tokens, so penalties
count those draft tokens too: target and draft distributions are warped identically.

A request with a seed samples each output position with noise of that position alone
(``PositionNoise``): the token at position t is a function of the seed, t and the target's
distribution there, so it does not depend on how many tokens were drafted before it, by which
drafter, or whether speculation is on. Without a seed, one uniform a draw from the request's
generator (``sample_from``), and rejection sampling under speculation (speculative/verify.py).
"""

from __future__ import annotations

import torch

from specserve.engine.types import SamplingParams, TokenLogprob
from specserve.kernels.noise import uniform_noise


def penalize(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
             drafts: list[int] = (), allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [R, V] for R consecutive positions -> copy with logit_bias added, the tokens a
    grammar does not allow (``allowed``: [R, V] bool, see engine/constraint.py) and the tokens
    that may not end a request before min_tokens banned, then penalized (R-1 <= len(drafts));
    vLLM's order."""
    if not params.modifies_logits and allowed is None:
        return logits
    # the grammar's ban first, in the copy itself (one pass): -inf stays -inf under what follows
    out = logits.clone() if allowed is None else torch.where(allowed, logits, float("-inf"))
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        out[:, list(ids)] += torch.tensor(bias, dtype=out.dtype)
    early = params.min_tokens - len(output_ids)  # rows 0 .. early - 1 come before min_tokens
    if early > 0 and params.end_token_ids:
        _ban_end(out, early, list(params.end_token_ids), allowed)
    if not params.has_penalties:
        return out
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=vocab)[:vocab].float()
    seen = torch.zeros(vocab, dtype=torch.bool)
    if prompt_ids or output_ids:
        seen[torch.tensor(prompt_ids + output_ids, dtype=torch.int64)] = True
    for j in range(out.shape[0]):
        if j > 0:
            counts[drafts[j - 1]] += 1
            seen[drafts[j - 1]] = True
        row = out[j]
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            row[seen] = torch.where(row[seen] > 0, row[seen] / r, row[seen] * r)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def _ban_end(out: torch.Tensor, early: int, end: list[int], allowed: torch.Tensor | None) -> None:
    """Ban the end tokens in rows before min_tokens, except where a grammar allows nothing else
    (a finished JSON value can only end: the grammar wins over min_tokens)."""
    if allowed is None:
        out[:early, end] = float("-inf")
        return
    for j in range(min(early, out.shape[0])):
        others = allowed[j].clone()
        others[end] = False
        if others.any():
            out[j, end] = float("-inf")


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] penalized logits -> [R, V] probabilities after temperature, top-k, top-p, min-p."""
    x = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) > params.top_p  # keeps at least the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] distribution by inverse CDF: exactly one uniform per draw."""
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cdf = probs.double().cumsum(0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=torch.float64)).item())
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] == 0 and idx > 0:  # land on a token that has mass
        idx -= 1
    return idx


class PositionNoise:
    """Exponential noise per output position of a seeded request: position t's [width] vector is
    -log of counter-based uniforms keyed by (seed, t) alone (kernels/noise.py). ``sample_at`` takes
    argmax p_i / E_i, an exact sample of p (the exponential race, the Gumbel-max trick's form without
    a second log); a drafter that picks its draft for position t with the same noise (``sample_at``
    on its own distribution) is right where the two distributions' races have the same winner,
    often where they are close.
    Vectors of positions before ``forget_before`` are dropped."""

    def __init__(self, seed: int, width: int):
        self.seed, self.width = seed, width
        self._at: dict[int, torch.Tensor] = {}

    def at(self, pos: int, width: int | None = None) -> torch.Tensor:
        """[width] float32 exponential noise of output position ``pos`` (a narrower head: the first
        ``width``; a wider one: the rest +inf, never picked)."""
        e = self._at.get(pos)
        if e is None:  # uniforms in (0, 1), a function of (seed, pos, token) alone: E in (0, 16.6]
            e = self._at[pos] = -torch.log(uniform_noise(mix_key(self.seed, pos), self.width))
        width = self.width if width is None else width
        if width <= self.width:
            return e[:width]
        return torch.cat([e, torch.full((width - self.width,), float("inf"))])

    def forget_before(self, pos: int) -> None:
        for t in [t for t in self._at if t < pos]:
            del self._at[t]


def mix_key(seed: int, pos: int) -> int:
    """A 64-bit key from a seed (any int: negative or wider seeds are taken mod 2^64) and a counter
    (splitmix64): a seeded request's noise key of position ``pos``; an unseeded request's key from
    the engine seed and its arrival number."""
    z = (seed * 0x9E37_79B9_7F4A_7C15 + (pos + 1) * 0xBF58_476D_1CE4_E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & 0xFFFF_FFFF_FFFF_FFFF
    return z ^ (z >> 31)


def sample_at(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """One token from a [V] distribution with a position's exponential noise [V] (PositionNoise)."""
    return int((probs.float() / noise).argmax())


def top_logprobs(logits: torch.Tensor, token_ids: list[int], n: int, *, rank: bool = False) -> list[TokenLogprob]:
    """logits: [R, V] raw -> the chosen token's logprob and the top-n alternatives per row (rank:
    also the token's rank, 1 + how many tokens score higher)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for j, tok in enumerate(token_ids):
        top = []
        if n:
            vals, idx = torch.topk(lp[j], n)
            top = list(zip(idx.tolist(), vals.tolist()))
        value = lp[j, tok]
        out.append(TokenLogprob(tok, float(value), top, int((lp[j] > value).sum()) + 1 if rank else None))
    return out


def generator_seed(seed: int) -> int:
    """The seed torch's CPU generator gets: it keeps only the low 32 bits, so a seed outside
    [0, 2**32) is mixed down (seeds 5 and 5 + 2**32 must not draw the same numbers)."""
    if 0 <= seed < 2 ** 32:
        return seed
    mixed = ((seed & 0xFFFF_FFFF_FFFF_FFFF) * 0x9E37_79B9_7F4A_7C15) & 0xFFFF_FFFF_FFFF_FFFF
    return mixed >> 32


def make_generator(key: int) -> torch.Generator:
    """A torch generator for a sequence's (or its drafter's) sampling key."""
    g = torch.Generator()
    g.manual_seed(generator_seed(key))
    return g
