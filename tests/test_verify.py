"""The verifier on hand-made distributions: greedy rules, exact rejection sampling."""

import torch

from specserve.engine.sampler import make_generator, probs_from_logits, sample_from
from specserve.engine.types import SamplingParams
from specserve.speculative.verify import verify_greedy, verify_sampling

V = 6
P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05], dtype=torch.float64)  # target
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10], dtype=torch.float64)  # draft


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(probs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_greedy_accepts_longest_matching_prefix_then_target_token():
    logits = torch.full((4, V), -1.0)
    for row, tok in enumerate([2, 5, 1, 3]):
        logits[row, tok] = 1.0
    assert verify_greedy(logits, [2, 5, 1]) == (3, [2, 5, 1, 3])  # all accepted + bonus
    assert verify_greedy(logits, [2, 4, 1]) == (1, [2, 5])  # recovered token at the first rejection
    assert verify_greedy(logits, [0, 5, 1]) == (0, [2])
    assert verify_greedy(logits[:1], []) == (0, [2])  # plain decode


def _run(verifier, n: int, k: int, seed: int, point_mass: bool = False,
         q: torch.Tensor = Q) -> tuple[torch.Tensor, torch.Tensor]:
    """Count the first and second output tokens over n verification steps (draft distribution q)."""
    g = make_generator(seed)
    first, second = torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)
    target = P.expand(k + 1, V).float()
    draft = None if point_mass else q.expand(k, V).float()
    for _ in range(n):
        drafts = [2] * k if point_mass else [sample_from(q.float(), g) for _ in range(k)]
        _, toks = verifier(target, drafts, draft, g)
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
    return first, second


def test_rejection_sampling_preserves_the_target_distribution():
    first, second = _run(verify_sampling, 100_000, 2, seed=1)
    assert chi2_pvalue(first, P) > 0.001
    assert chi2_pvalue(second, P) > 0.001  # tokens after an accepted draft are exact too


def test_point_mass_drafter_preserves_the_target_distribution():
    first, _ = _run(verify_sampling, 100_000, 1, seed=2, point_mass=True)
    assert chi2_pvalue(first, P) > 0.001


def test_draft_with_a_cut_vocabulary_preserves_the_target_distribution():
    """A draft vocabulary (spec/draft_vocab.py) leaves tokens out of the draft's support: q = 0
    there, and the residual must supply them at exactly their target probability."""
    q = torch.tensor([0.0, 0.20, 0.50, 0.0, 0.30, 0.0], dtype=torch.float64)
    first, second = _run(verify_sampling, 100_000, 2, seed=5, q=q)
    assert chi2_pvalue(first, P) > 0.001
    assert chi2_pvalue(second, P) > 0.001


def _no_residual(target, drafts, draft_probs, generator):
    """A wrong verifier: on rejection it samples from p instead of norm(max(p - q, 0))."""
    for j, d in enumerate(drafts):
        q = draft_probs[j, d].item() if draft_probs is not None else 1.0
        if torch.rand((), generator=generator, dtype=torch.float64).item() < min(1.0, target[j, d].item() / q):
            continue
        return j, list(drafts[:j]) + [sample_from(target[j], generator)]
    return len(drafts), list(drafts) + [sample_from(target[len(drafts)], generator)]


def test_the_test_catches_a_verifier_without_residual_resampling():
    first, _ = _run(_no_residual, 100_000, 2, seed=3)
    assert chi2_pvalue(first, P) < 0.001


def test_seeded_runs_reproduce_exactly():
    a = _run(verify_sampling, 2000, 3, seed=7)
    b = _run(verify_sampling, 2000, 3, seed=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_warping_is_applied_identically():
    logits = torch.log(P.float())[None].repeat(2, 1)
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05)
    probs = probs_from_logits(logits, params)
    assert torch.equal(probs[0], probs[1])
    assert (probs[0][3:] == 0).all() and abs(float(probs[0].sum()) - 1) < 1e-6


def test_generator_seed_keeps_32_bit_seeds_and_mixes_the_rest():
    from specserve.engine.sampler import generator_seed
    assert [generator_seed(s) for s in (0, 5, 2 ** 32 - 1)] == [0, 5, 2 ** 32 - 1]
    wide = [5 + 2 ** 32, 5 + 2 ** 40, -1, -(2 ** 63), 2 ** 63 - 1]
    mixed = [generator_seed(s) for s in wide]
    assert all(0 <= m < 2 ** 32 for m in mixed) and len(set(mixed) | {5}) == len(wide) + 1
    draws = {tuple(torch.rand(4, generator=make_generator(s)).tolist()) for s in [5, *wide]}
    assert len(draws) == len(wide) + 1
