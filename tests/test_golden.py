"""Greedy tokens of fixed prompts and configurations equal the committed golden file.

The file was recorded before the engine's redesign into cache specs, a scheduler and a model
runner: structural changes keep every token. See ``tests/golden.py`` for the cases."""

from __future__ import annotations

import json

import pytest

from golden import CASES, GOLDEN_FILE, run_case

GOLDEN = json.loads(GOLDEN_FILE.read_text())


def test_golden_file_covers_every_case_and_is_lossless():
    assert set(GOLDEN) == {c.name for c in CASES}
    for c in CASES:
        if c.reference:  # speculative / chunked / cached runs equal their plain run
            assert GOLDEN[c.name] == GOLDEN[c.reference][:c.num_prompts], c.name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_tokens_equal_the_golden_file(case, tmp_path):
    got = run_case(case, tmp_path)
    want = GOLDEN[case.name]
    for i, (a, b) in enumerate(zip(want, got)):
        assert a == b, f"{case.name} prompt {i}: first difference at token " \
                       f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
    assert len(got) == len(want)
