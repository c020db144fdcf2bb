"""Greedy output with speculation is token-for-token the greedy output without it, and so is a
seeded request's sampled output."""

import json

import pytest

from engine_utils import bench_prompts, chat_ids, make_engine, run_all
from specserve.engine.types import SamplingParams

CHAT = [
    "Hi! How are you today?",
    "Tell me a short joke about computers.",
    "What should I cook for dinner tonight? Give three ideas.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
]
GREEDY_128 = SamplingParams(max_tokens=128, ignore_eos=False)


@pytest.fixture(scope="module")
def prompts_and_plain():
    plain = make_engine("--model", "smollm2-135m", "--max-num-seqs", "8")
    texts = bench_prompts(6) + CHAT  # 22 prompts: code, math, prose, chat
    prompts = [chat_ids(plain, t) for t in texts]
    return prompts, run_all(plain, prompts, GREEDY_128)


@pytest.mark.parametrize("spec", [
    '{"method": "ngram", "num_speculative_tokens": 8, "adaptive": false}',
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3}',
    '{"method": "draft_model", "model": "smollm2-135m", "quantization": "int8", "num_speculative_tokens": 4}',
    # a 4-bit draft over a cut vocabulary that grows with the tokens the prompts use
    '{"method": "draft_model", "model": "smollm2-135m", "quantization": "q4_0", "draft_vocab_size": 2048, '
    '"draft_lookup_tokens": 6}',  # (the one above checks 3 guesses of prompt lookup a forward, the default)
    '{"method": "suffix", "num_speculative_tokens": 8}',
])
def test_speculative_greedy_equals_plain_greedy_smollm2(prompts_and_plain, spec):
    prompts, plain = prompts_and_plain
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "8", "--speculative-config", spec)
    got = run_all(engine, prompts, GREEDY_128)
    for i, (a, b) in enumerate(zip(plain, got)):
        assert a == b, f"prompt {i}: first difference at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
    assert engine.totals.draft_tokens > 0 and engine.totals.accepted_tokens > 0  # speculation really ran
    assert engine.blocks.num_free == engine.blocks.num_blocks


SEEDED = SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=2026)


@pytest.mark.parametrize("spec", [
    '{"method": "ngram", "num_speculative_tokens": 8}',
    '{"method": "suffix", "num_speculative_tokens": 8}',
    '{"method": "draft_model", "model": "smollm2-135m", "quantization": "q4_0", "num_speculative_tokens": 4, '
    '"adaptive": false}',  # (fixed k: the model drafters draft in every step, alone too)
    '{"method": "dflash", "model": "smollm2-135m-dflash", "num_speculative_tokens": 7, "adaptive": false}',
])
def test_seeded_sampling_with_speculation_equals_plain(prompts_and_plain, spec):
    """At temperature > 0 a seeded request samples each position with that position's noise: its
    tokens with speculation equal its tokens without, batched or alone, and again after the
    drafter has seen the answers (suffix decoding then drafts them, so each position's draft
    differs from the first run's)."""
    prompts = prompts_and_plain[0][10:18]  # math, prose, chat
    plain = run_all(make_engine("--model", "smollm2-135m", "--max-num-seqs", "8"), prompts, SEEDED)
    assert len({tuple(t) for t in plain}) == len(plain)
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "8", "--speculative-config", spec)
    assert run_all(engine, prompts, SEEDED) == plain
    assert engine.totals.draft_tokens > 0 and engine.totals.accepted_tokens > 0
    drafted = engine.totals.draft_tokens
    assert [run_all(engine, [p], SEEDED)[0] for p in prompts[:3]] == plain[:3]  # one at a time, drafted anew
    assert engine.totals.draft_tokens > drafted
    assert engine.blocks.num_free == engine.blocks.num_blocks


SUFFIX_THEN_DRAFT = {"method": "chain", "num_speculative_tokens": 8, "drafters": [
    {"method": "suffix"}, {"method": "draft_model", "model": "smollm2-135m", "quantization": "int8",
                           "num_speculative_tokens": 4}]}
NGRAM_THEN_DFLASH = {"method": "chain", "num_speculative_tokens": 7, "drafters": [
    {"method": "ngram", "prompt_lookup_min": 3}, {"method": "dflash", "model": "smollm2-135m-dflash"}]}


@pytest.mark.parametrize("chain", [SUFFIX_THEN_DRAFT, NGRAM_THEN_DFLASH])
@pytest.mark.parametrize("max_num_seqs", [8, 1])
def test_chained_drafters_equal_plain_greedy(prompts_and_plain, chain, max_num_seqs):
    """A chain, batched 8 and alone, at a fixed draft length (so that both drafters draft): the
    model drafter runs only where the first one has nothing, and the output stays plain greedy's."""
    prompts, plain = prompts_and_plain
    n = 8 if max_num_seqs == 8 else 2
    prompts, plain = prompts[:n], [p[:64] for p in plain[:n]]  # greedy's first 64 tokens
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", str(max_num_seqs), "--speculative-config",
                         json.dumps(dict(chain, adaptive=False)))
    assert run_all(engine, prompts, SamplingParams(max_tokens=64)) == plain
    assert all(w > 0 for w in engine.drafter.wins), engine.drafter.wins  # both drafters' proposals verified
    assert engine.totals.accepted_tokens > 0 and engine.blocks.num_free == engine.blocks.num_blocks
    model = engine.drafter.drafters[1]
    if hasattr(model, "blocks"):  # the draft model's own KV pool
        assert model.blocks.num_free == model.blocks.num_blocks


def test_suffix_alone_and_a_repeated_request_hits_the_cache(prompts_and_plain):
    """One request at a time: greedy output equals plain; asked again, each request's answer comes
    from the cache of earlier outputs (most tokens are accepted drafts), still plain's tokens."""
    prompts, plain = prompts_and_plain
    pick = [0, 6, 12]  # code, math, prose
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "1", "--speculative-config",
                         '{"method": "suffix", "num_speculative_tokens": 8}')
    accepted = []
    for _ in range(2):
        before = engine.totals.accepted_tokens
        assert run_all(engine, [prompts[i] for i in pick], GREEDY_128) == [plain[i] for i in pick]
        accepted.append(engine.totals.accepted_tokens - before)
    assert accepted[1] > 2 * accepted[0] and accepted[1] > 0.5 * sum(len(plain[i]) for i in pick), accepted
    assert len(engine.drafter.cache) == 2 * len(pick)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_draft_model_pair_qwen_coder_is_lossless():
    params = SamplingParams(max_tokens=24)
    target = make_engine("--model", "qwen2.5-coder-1.5b", "--max-num-seqs", "2", "--max-model-len", "1024")
    texts = ["Write a Python function that reverses a linked list.", "What is 17 * 23? Answer briefly."]
    prompts = [chat_ids(target, t) for t in texts]
    plain = run_all(target, prompts, params)
    del target
    spec = make_engine("--model", "qwen2.5-coder-1.5b", "--max-num-seqs", "2", "--max-model-len", "1024",
                       "--speculative-config",
                       '{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4, '
                       '"quantization": "q4_0", "draft_vocab_size": 32768}')
    assert run_all(spec, prompts, params) == plain
    assert spec.totals.accepted_tokens > 0


def test_draft_model_cache_reused_with_the_prefix_cache(prompts_and_plain):
    """The draft model's own KV is reused in step with the target's: a repeated prompt starts
    both caches from the cached prefix, and the tokens still equal plain greedy decoding."""
    prompts, plain = prompts_and_plain
    # a fixed draft length: the drafter runs from the first decode step (an adaptive policy may
    # start at k = 0, and a draft state created later matches generated tokens too)
    spec = ('{"method": "draft_model", "model": "smollm2-135m", "quantization": "int8", "num_speculative_tokens": 4, '
            '"adaptive": false}')
    engine = make_engine("--model", "smollm2-135m", "--speculative-config", spec)
    seen: dict[str, tuple[int, int]] = {}
    for rid in ("cold", "warm"):
        engine.add_request(rid, prompts[0], GREEDY_128)
        got = []
        while engine.has_work():
            for seq in engine.running:
                st = seq.drafter_state.get("draft_model")
                if st is not None:
                    seen[rid] = (seq.num_cached, st.num_cached)
            got += [t for out in engine.step() for t in out.new_token_ids]
        assert got == plain[0]
    bs = engine.ecfg.block_size
    full = (len(prompts[0]) - 1) // bs * bs
    assert seen["warm"] == (full, full)  # target and draft both skip every full cached block
    assert engine.drafter.blocks.num_free == engine.drafter.blocks.num_blocks  # nothing leaked
    assert engine.drafter.blocks.cached  # finished sequences' blocks stay cached for reuse


@pytest.mark.parametrize("spec", [
    '{"method": "ngram", "num_speculative_tokens": 8, "adaptive": false}',
    '{"method": "dflash", "model": "smollm2-135m-dflash", "num_speculative_tokens": 7, "adaptive": false}',
])
def test_logit_bias_with_speculation_equals_plain(prompts_and_plain, spec):
    """logit_bias changes the target's distribution; drafts and verification both see it, so
    greedy output with speculation still equals plain greedy output with the same bias."""
    from collections import Counter

    prompts, plain = prompts_and_plain
    prompts = prompts[:4]
    top = Counter(t for out in plain[:4] for t in out).most_common(2)  # ban the commonest, favour the next
    params = SamplingParams(max_tokens=64, logit_bias=((top[0][0], -100.0), (top[1][0], 2.5)))
    want = run_all(make_engine("--model", "smollm2-135m", "--max-num-seqs", "4"), prompts, params)
    assert all(top[0][0] not in out for out in want) and want != [p[:64] for p in plain[:4]]
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--speculative-config", spec)
    assert run_all(engine, prompts, params) == want
    assert engine.totals.accepted_tokens > 0


@pytest.mark.parametrize("spec", [
    '{"method": "ngram", "num_speculative_tokens": 8, "adaptive": false}',
    '{"method": "draft_model", "model": "smollm2-135m", "quantization": "q4_0", "num_speculative_tokens": 4, '
    '"adaptive": false}',
])
def test_min_tokens_with_speculation_equals_plain(prompts_and_plain, spec):
    """min_tokens bans the ends of a request (here a common token as a stop token id) on the rows
    before the minimum, in drafts and verification alike: greedy output stays plain greedy's."""
    from collections import Counter

    prompts, plain = prompts_and_plain
    prompts = prompts[:4]
    common = Counter(t for out in plain[:4] for t in out[:20]).most_common(1)[0][0]
    params = SamplingParams(max_tokens=48, stop_token_ids=(common,), min_tokens=24)
    want = run_all(make_engine("--model", "smollm2-135m", "--max-num-seqs", "4"), prompts, params)
    assert all(len(out) >= 24 and common not in out[:23] for out in want)
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--speculative-config", spec)
    assert run_all(engine, prompts, params) == want
    assert engine.totals.accepted_tokens > 0


@pytest.mark.parametrize("spec,k", [
    ({"method": "draft_model", "model": "smollm2-135m", "quantization": "q4_0"}, 4),
    ({"method": "dflash", "model": "smollm2-135m-dflash"}, 7),
])
def test_draft_p_min_cuts_unsure_drafts_and_stays_lossless(prompts_and_plain, spec, k):
    """draft_p_min (llama.cpp's --draft-p-min): a draft stops at a token the draft gives less
    than p_min; fewer drafts are verified, more of them are accepted, the output is unchanged."""
    prompts, plain = prompts_and_plain
    tokens = 64  # greedy: the first 64 tokens of the plain outputs are the plain outputs at 64
    prompts, plain = prompts[:6], [out[:tokens] for out in plain[:6]]
    params = SamplingParams(max_tokens=tokens)
    rates = {}
    for p_min in (0.0, 0.8):
        cfg = dict(spec, num_speculative_tokens=k, adaptive=False, draft_p_min=p_min)
        engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "6", "--speculative-config",
                             json.dumps(cfg))
        assert run_all(engine, prompts, params) == plain
        t = engine.totals
        rates[p_min] = (t.draft_tokens / t.steps, t.accepted_tokens / max(t.draft_tokens, 1))
    assert rates[0.0][0] > 0.9 * k and rates[0.8][0] < 0.75 * k, rates  # drafts cut (fewer near max_tokens)
    assert rates[0.8][1] > rates[0.0][1], rates  # and the ones kept are accepted more often
