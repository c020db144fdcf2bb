"""Prompt lookup's search (ngram drafts, and the guesses a draft model checks)."""

import random

from specserve.speculative.ngram import find_continuation


def reference(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The definition, one n at a time: the latest earlier occurrence of the last n tokens."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n:]
        for start in range(total - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_one_pass_finds_what_the_definition_finds():
    rnd = random.Random(0)
    cases = 0
    for _ in range(3000):
        alphabet = rnd.choice((2, 3, 5, 40))  # small alphabets: many matches of every length
        tokens = [rnd.randrange(alphabet) for _ in range(rnd.randrange(1, 40))]
        n_min = rnd.randrange(1, 4)
        n_max = n_min + rnd.randrange(0, 5)
        k = rnd.randrange(1, 6)
        want = reference(tokens, n_min, n_max, k)
        assert find_continuation(tokens, n_min, n_max, k) == want, (tokens, n_min, n_max, k)
        cases += bool(want)
    assert cases > 1000  # most cases found something to propose


def test_the_longest_match_wins_over_a_later_shorter_one():
    #        a  b  c  X  .  .  b  c  Y  .  a  b  c
    tokens = [1, 2, 3, 7, 0, 0, 2, 3, 8, 0, 1, 2, 3]
    assert find_continuation(tokens, 2, 5, 2) == [7, 0]  # "1 2 3" (3 tokens) beats the later "2 3"
    assert find_continuation(tokens, 2, 2, 2) == [8, 0]  # at most 2: the latest "2 3"
    assert find_continuation(tokens, 4, 5, 2) == [] and find_continuation([5], 1, 3, 2) == []
