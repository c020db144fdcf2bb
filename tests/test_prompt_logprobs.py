"""Prompt logprobs (vLLM's ``prompt_logprobs``; OpenAI's completions with echo + logprobs) on the
real default model: each prompt token's logprob after the tokens before it."""

import math

import pytest

from engine_utils import bench_prompts, chat_ids, make_engine, run_one
from specserve.engine.types import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def continued(engine):
    """A chat prompt and its greedy continuation of 8 tokens with their logprobs (top 3): scored
    again as a prompt, the continuation must get the same numbers."""
    prefix = chat_ids(engine, bench_prompts(1)[0])
    lps = []
    for out in engine.generate(prefix, SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True), request_id="c"):
        lps += out.new_logprobs
    return prefix, lps


def scored(engine, ids: list[int], k: int = 3, max_tokens: int = 0, request_id: str = "p"):
    """(prompt logprobs, outputs) of a request for ids' prompt logprobs."""
    outs = list(engine.generate(ids, SamplingParams(max_tokens=max_tokens, prompt_logprobs=k,
                                                    ignore_eos=True), request_id=request_id))
    got = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(got) == 1, "prompt logprobs come once"
    return got[0], outs


def same_numbers(a, b):
    assert a.token_id == b.token_id
    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_a_continuation_scores_as_it_was_generated(engine, continued):
    prefix, lps = continued
    ids = prefix + [lp.token_id for lp in lps]
    prompt_lps, outs = scored(engine, ids)
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for lp, tok in zip(prompt_lps[1:], ids[1:]):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        higher = sum(v > lp.logprob for _, v in lp.top)  # of the top 3
        assert lp.rank == higher + 1 if higher < 3 else lp.rank > 3
    for got, want in zip(prompt_lps[len(prefix):], lps):  # greedy: each the best, rank 1
        same_numbers(got, want)
        assert got.rank == 1
    # max_tokens 0: the prompt alone, no token, finished by length
    assert [o.new_token_ids for o in outs] == [[]] and outs[-1].finish_reason == "length"
    assert outs[-1].completion_tokens == 0 and engine.blocks.num_free == engine.blocks.num_blocks


def test_chunked_cached_and_generating_requests_score_alike(engine, continued):
    """Prompt logprobs do not depend on how the prompt is computed: in chunks of 37 rows, or after
    the same prompt's blocks are in the prefix cache (a request for prompt logprobs computes its
    whole prompt: it matches nothing), or with tokens generated after it."""
    prefix, lps = continued
    ids = prefix + [lp.token_id for lp in lps]
    want, _ = scored(engine, ids)
    run_one(engine, ids, SamplingParams(max_tokens=2))  # the prompt's blocks now cached
    cached, outs = scored(engine, ids, max_tokens=4, request_id="p2")
    assert outs[-1].cached_tokens == 0 and sum(len(o.new_token_ids) for o in outs) == 4
    chunked_engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "2", "--max-model-len", "1024",
                                 "--max-num-batched-tokens", "37")
    chunked, _ = scored(chunked_engine, ids)
    for got in (cached, chunked):
        assert got[0] is None and len(got) == len(want)
        for a, b in zip(got[1:], want[1:]):
            same_numbers(a, b)
    # the plain request after it still finds the blocks: the scoring request left the cache usable
    _, out = run_one(engine, ids, SamplingParams(max_tokens=2))
    assert out.cached_tokens > 0


def test_speculation_keeps_prompt_logprobs_and_the_output(continued):
    """With a drafter on, the output stays the plain greedy one and the prompt logprobs the same."""
    prefix, lps = continued
    plain = make_engine("--model", "smollm2-135m", "--max-num-seqs", "2", "--max-model-len", "1024")
    spec = make_engine("--model", "smollm2-135m", "--max-num-seqs", "2", "--max-model-len", "1024",
                       "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}')
    (a_lps, a_outs), (b_lps, b_outs) = (scored(e, prefix, max_tokens=24) for e in (plain, spec))
    assert [t for o in a_outs for t in o.new_token_ids] == [t for o in b_outs for t in o.new_token_ids]
    for a, b in zip(a_lps[1:], b_lps[1:]):
        same_numbers(a, b)
    probs = [math.exp(lp.logprob) for lp in a_lps[1:]]
    assert all(0 < p <= 1 for p in probs)
