"""Prompt lookup (n-gram) drafting, like vLLM's ``ngram`` and llama.cpp's ``ngram-simple``.

Find the most recent earlier occurrence of the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it.
"""

from __future__ import annotations

from specserve.engine.sequence import Sequence
from specserve.speculative.drafter import Drafter, Proposal


def find_continuation(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Tokens that followed the latest earlier match of the longest suffix n-gram (n from n_max
    down to n_min). One backward pass: at each earlier position holding the last token, the
    length of the match ending there; the first (latest) position with the longest match wins."""
    total = len(tokens)
    n_max = min(n_max, total - 1)
    if n_max < n_min:
        return []
    last, best_n, best_end = tokens[-1], 0, -1
    for end in range(total - 2, n_min - 2, -1):  # the match's last token; it starts at >= 0
        if tokens[end] != last:
            continue
        n, cap = 1, min(n_max, end + 1)
        while n < cap and tokens[end - n] == tokens[total - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == n_max:
                break
    return tokens[best_end + 1:best_end + 1 + k] if best_n >= n_min else []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 5):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [Proposal(find_continuation(s.token_ids, self.n_min, self.n_max, k) if k else [])
                for s, k in zip(seqs, num_tokens)]
