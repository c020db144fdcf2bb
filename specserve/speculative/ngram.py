"""Prompt lookup (n-gram) drafting, like vLLM's ``ngram`` and llama.cpp's ``ngram-simple``.

Find the most recent earlier occurrence of the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it.
"""

from __future__ import annotations

from specserve.engine.sequence import Sequence
from specserve.speculative.drafter import Drafter, Proposal


def find_continuation(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Tokens that followed the latest earlier match of the longest suffix n-gram."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n:]
        first = suffix[0]
        # scan backwards so the most recent match wins
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 5):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [Proposal(find_continuation(s.token_ids, self.n_min, self.n_max, k) if k else [])
                for s, k in zip(seqs, num_tokens)]
