"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's ``suffix`` method): model-free
drafts from suffix trees over the request itself and over earlier requests' outputs.

Two ``SuffixTree``s (spec/suffix_tree.py) are searched each step:

* the request's own tree, over its prompt and its output so far, grown by the tokens verified
  since the sequence last drafted (O(new tokens x depth); nothing is rebuilt);
* one tree shared by the engine over the outputs of finished requests, at most
  ``suffix_decoding_max_cached_requests`` of them, least recently used evicted whole (a cached
  output the drafts came from counts as used when the drafting request finishes).

For every length m of the context's last tokens that occurred before (up to
``suffix_decoding_max_tree_depth``), the likeliest continuation is followed branch by branch
(the most frequent next token, its probability the product of frequency ratios so far) for up
to ``floor(max_spec_factor * m + max_spec_offset)`` tokens, and stops before a token whose
probability is under ``suffix_decoding_min_token_prob``. The continuation with the highest
expected number of accepted tokens (the sum of the probabilities) is proposed. Long matches
(a file being copied, an answer asked again) give long drafts; a weak match gives a short one
or none. Drafts are point masses, so verification stays exact at any temperature.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from specserve.engine.sequence import Sequence
from specserve.speculative.drafter import Drafter, Proposal
from specserve.speculative.suffix_tree import SuffixTree

DEFAULT_MAX_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 1000
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MAX_SPEC_OFFSET = 0.0
DEFAULT_MIN_TOKEN_PROB = 0.1
_OWN = 0  # the key of the request's own sequence in its tree


@dataclass
class _State:
    tree: SuffixTree
    seen: int = 0  # tokens of the sequence in its tree
    hits: set = field(default_factory=set)  # cached outputs that drafts came from
    generator: torch.Generator | None = None


@dataclass
class _Draft:
    tokens: list[int]
    score: float
    source: object = None  # the cached output it came from (None: the request itself)


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
                 max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR, max_spec_offset: float = DEFAULT_MAX_SPEC_OFFSET,
                 min_token_prob: float = DEFAULT_MIN_TOKEN_PROB):
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.factor, self.offset, self.min_prob = max_spec_factor, max_spec_offset, min_token_prob
        self.cache = SuffixTree(max_depth) if max_cached_requests > 0 else None  # earlier outputs
        self._keys = itertools.count()
        self.step_time = 0.0  # seconds per sequence's lookup (running average)

    @classmethod
    def from_spec(cls, spec) -> "SuffixDrafter":
        def pick(value, default):
            return default if value is None else value

        return cls(pick(spec.suffix_decoding_max_tree_depth, DEFAULT_MAX_DEPTH),
                   pick(spec.suffix_decoding_max_cached_requests, DEFAULT_MAX_CACHED_REQUESTS),
                   pick(spec.suffix_decoding_max_spec_factor, DEFAULT_MAX_SPEC_FACTOR),
                   pick(spec.suffix_decoding_max_spec_offset, DEFAULT_MAX_SPEC_OFFSET),
                   pick(spec.suffix_decoding_min_token_prob, DEFAULT_MIN_TOKEN_PROB))

    def _state(self, seq: Sequence) -> _State:
        def fresh() -> _State:
            st = _State(SuffixTree(self.max_depth))
            st.tree.start(_OWN)
            return st

        st = self.seq_state(seq, fresh)
        toks = seq.token_ids
        st.tree.extend(_OWN, toks[st.seen:])  # the prompt at first, then what was verified since
        st.seen = len(toks)
        return st

    def _budget(self, m: int, k: int) -> int:
        """Most tokens a match of m tokens may propose: at most k, within the trees' depth, and
        at most max_spec_factor * m + max_spec_offset (short matches are weak evidence)."""
        return max(0, min(k, self.max_depth - m, math.floor(self.factor * m + self.offset)))

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, num_tokens):
            if k <= 0:
                out.append(Proposal([]))
                continue
            st = self._state(seq)
            t0 = time.perf_counter()
            best = self._best(st, seq, k)
            dt = time.perf_counter() - t0
            self.step_time = dt if not self.step_time else 0.9 * self.step_time + 0.1 * dt
            if best.source is not None:
                st.hits.add(best.source)
            out.append(Proposal(best.tokens, cut=len(best.tokens) < k))
        return out

    def _best(self, st: _State, seq: Sequence, k: int) -> _Draft:
        best = _Draft([], 0.0)
        for node in st.tree.suffix_nodes(_OWN):  # every suffix of the context, longest first
            budget = self._budget(node.depth, k)
            if node.children is not None and budget > best.score:
                toks, score, _ = st.tree.continuation(node, node.depth, budget, self.min_prob)
                if score > best.score:
                    best = _Draft(toks, score)
        if self.cache is None or not len(self.cache):
            return best
        pattern = seq.token_ids[-self.max_depth:]
        found = []
        for m in range(1, len(pattern) + 1):  # a context that never occurred has no longer one that did
            where = self.cache.locate(pattern[len(pattern) - m:])
            if where is None:
                break
            found.append(where)
        for node, m in reversed(found):
            budget = self._budget(m, k)
            if budget > best.score:
                toks, score, _ = self.cache.continuation(node, m, budget, self.min_prob)
                if score > best.score:
                    best = _Draft(toks, score, node.seq)
        return best

    def on_finished(self, seq: Sequence) -> None:
        st = seq.drafter_state.pop(self.name, None)
        if self.cache is None or not seq.finished or not seq.output_ids:
            return  # a preempted sequence comes back (its tree is rebuilt then)
        for key in st.hits if st is not None else ():
            self.cache.touch(key)
        self.cache.insert(next(self._keys), list(seq.output_ids))
        self.cache.evict(self.max_cached)

    def draft_cost(self, k: int) -> float:
        return self.step_time if k > 0 else 0.0
