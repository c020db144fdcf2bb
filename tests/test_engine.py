"""Engine behaviour on the real default model: batching, chunking, prefix cache, sampling, limits."""

import pytest

from engine_utils import bench_prompts, chat_ids, make_engine, run_all, run_one
from specserve.engine.types import SamplingParams
from specserve.errors import RequestError

GREEDY = SamplingParams(max_tokens=48)


@pytest.fixture(scope="module")
def engine():
    return make_engine("--model", "smollm2-135m", "--max-num-seqs", "8", "--max-model-len", "2048")


@pytest.fixture(scope="module")
def prompts(engine):
    return [chat_ids(engine, t) for t in bench_prompts(3)[:8]]


def test_alone_equals_batched_with_seven_others(engine, prompts):
    batched = run_all(engine, prompts, GREEDY)
    alone = [run_one(engine, p, GREEDY)[0] for p in prompts[:3]]
    assert alone == batched[:3]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_chunked_prefill_equals_one_shot(prompts):
    long_prompt = sum(prompts[:4], [])  # a few hundred tokens
    one_shot = make_engine("--model", "smollm2-135m", "--max-num-seqs", "2", "--max-model-len", "2048",
                           "--no-enable-prefix-caching")
    chunked = make_engine("--model", "smollm2-135m", "--max-num-seqs", "2", "--max-model-len", "2048",
                          "--max-num-batched-tokens", "37", "--no-enable-prefix-caching")
    assert run_one(one_shot, long_prompt, GREEDY)[0] == run_one(chunked, long_prompt, GREEDY)[0]


def test_prefix_cache_hit_counts_and_same_output(engine, prompts):
    base = prompts[0] + prompts[1]
    cold, out_cold = run_one(engine, base, GREEDY)
    warm, out_warm = run_one(engine, base, GREEDY)
    assert warm == cold
    bs = engine.ecfg.block_size
    assert out_warm.cached_tokens == ((len(base) - 1) // bs) * bs  # every full block but the last token's
    other, out_other = run_one(engine, base[:bs * 2] + [42, 43, 44], GREEDY)
    assert out_other.cached_tokens == 2 * bs


def test_preemption_when_the_pool_is_full_keeps_outputs(prompts):
    params = SamplingParams(max_tokens=64)
    roomy = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--max-model-len", "512")
    want = run_all(roomy, prompts[:4], params)
    per_token = roomy.plan.kv_bytes_per_token
    tight = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--max-model-len", "512",
                        "--kv-cache-memory", str(per_token * 16 * 34), "--no-enable-prefix-caching")
    assert run_all(tight, prompts[:4], params) == want
    assert tight.blocks.num_free == tight.blocks.num_blocks


def test_seeded_sampling_reproduces_and_differs_across_seeds(engine, prompts):
    p1 = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=123)
    a = run_one(engine, prompts[2], p1)[0]
    b = run_one(engine, prompts[2], p1)[0]
    c = run_one(engine, prompts[2], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7))[0]
    assert a == b and a != c
    # torch's CPU generator keeps 32 bits of a seed: the high bits must still matter
    d = run_one(engine, prompts[2], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=123 + 2 ** 32))[0]
    assert d != a


def test_engine_seed_repeats_a_run_of_unseeded_requests(prompts):
    """--seed N (vLLM's): the same unseeded sampled requests in the same order give the same texts in
    a new engine (a restarted server); each request still samples apart from the others, and
    another engine seed gives other texts. (Request ids are random per run and do not count.)"""
    params = SamplingParams(max_tokens=16, temperature=1.0)

    def run(seed: int) -> list[list[int]]:
        eng = make_engine("--model", "smollm2-135m", "--max-model-len", "512", "--seed", str(seed))
        return [run_one(eng, prompts[1], params)[0] for _ in range(3)]

    first = run(42)
    assert run(42) == first and len({tuple(t) for t in first}) == 3
    assert run(43) != first


def test_prefill_time_leaves_out_the_queue(prompts):
    """llama-server's prompt_ms (the prefill time here) runs from admission: a request queued behind
    another (--max-num-seqs 1) waits through the first one's whole decode, which its time to first
    token counts and its prefill time does not."""
    eng = make_engine("--model", "smollm2-135m", "--max-model-len", "512", "--max-num-seqs", "1")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for rid in ("first", "queued"):
        eng.add_request(rid, prompts[0], params)
    last = {}
    while len(last) < 2:
        last.update({out.request_id: out for out in eng.step() if out.finished})
    queued, first = last["queued"], last["first"]
    assert queued.first_token_latency > first.first_token_latency + first.decode_time
    assert queued.prefill_time < queued.first_token_latency - first.decode_time


def test_stop_strings_max_tokens_and_logprobs(engine, prompts):
    toks, last = run_one(engine, prompts[0], SamplingParams(max_tokens=5, logprobs=3))
    assert len(toks) == 5 and last.finish_reason == "length"
    full = engine.tokenizer.decode(run_one(engine, prompts[0], SamplingParams(max_tokens=40))[0])
    stop = full[10:14]
    text = []
    for out in engine.generate(prompts[0], SamplingParams(max_tokens=40, stop=(stop,)), request_id="stop-test"):
        text.append(out.new_text)
    assert "".join(text) == full[:full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # vLLM's stop_reason: the string
    assert last.stop_reason is None  # ended by max_tokens
    # an empty stop string is no stop string (it ended every request after one token)
    assert SamplingParams(stop=("", stop)).stop == (stop,)
    toks, last = run_one(engine, prompts[0], SamplingParams(max_tokens=5, stop=("",)))
    assert len(toks) == 5 and last.finish_reason == "length"


def test_include_stop_str_in_output_and_min_tokens(engine, prompts):
    """vLLM's include_stop_str_in_output ends the text after the stop string; min_tokens bans EOS
    and stop_token_ids, and ignores stop strings, until that many tokens are out."""
    ids = run_one(engine, prompts[0], SamplingParams(max_tokens=40))[0]
    full = engine.tokenizer.decode(ids)
    stop = full[10:14]
    params = SamplingParams(max_tokens=40, stop=(stop,), include_stop_str_in_output=True)
    text = "".join(o.new_text for o in engine.generate(prompts[0], params, request_id="incl"))
    assert text == full[:full.index(stop) + len(stop)]
    early = ids[2]  # as a stop token id, plain greedy ends after 3 tokens
    ended, last = run_one(engine, prompts[0], SamplingParams(max_tokens=40, stop_token_ids=(early,)))
    assert ended == ids[:3] and last.stop_reason == early  # ... or the stop token id
    held, last = run_one(engine, prompts[0], SamplingParams(max_tokens=40, stop_token_ids=(early,), min_tokens=12))
    assert len(held) >= 12 and early not in held[:11] and held[:2] == ids[:2]
    assert last.finish_reason in ("stop", "length") and (last.finish_reason == "length" or held[-1] == early)
    past = run_one(engine, prompts[0], SamplingParams(max_tokens=40, stop=(stop,), min_tokens=30))[0]
    assert len(past) >= 30  # the stop string early in the text did not end it
    eos = min(engine.tokenizer.eos_token_ids)  # an EOS forced by logit_bias still waits for min_tokens
    forced = SamplingParams(max_tokens=20, logit_bias=((eos, 100.0),), min_tokens=5)
    toks, last = run_one(engine, prompts[0], forced)
    assert len(toks) == 6 and toks[-1] == eos and eos not in toks[:5] and last.finish_reason == "stop"
    assert last.stop_reason is None  # EOS is no stop_reason, as in vLLM
    with pytest.raises(RequestError, match="min_tokens must be in"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_stop_token_text_and_special_tokens(engine, prompts):
    """As vLLM: a stop token ends the text without its own text unless include_stop_str_in_output;
    skip_special_tokens false writes special tokens (here the forced EOS) into the text."""
    ids = run_one(engine, prompts[0], SamplingParams(max_tokens=40))[0]
    dec = engine.tokenizer.decode
    stop_id = ids[5]
    for include, want in ((False, dec(ids[:5])), (True, dec(ids[:6]))):
        params = SamplingParams(max_tokens=40, stop_token_ids=(stop_id,), include_stop_str_in_output=include)
        outs = list(engine.generate(prompts[0], params, request_id=f"st-{include}"))
        assert sum((o.new_token_ids for o in outs), []) == ids[:6]  # the token itself is in the ids
        assert "".join(o.new_text for o in outs) == want
    eos = min(engine.tokenizer.eos_token_ids)
    forced = dict(max_tokens=4, logit_bias=((eos, 100.0),), min_tokens=2)
    for skip in (True, False):
        p = SamplingParams(**forced, skip_special_tokens=skip, include_stop_str_in_output=True)
        text = "".join(o.new_text for o in engine.generate(prompts[0], p, request_id=f"sp-{skip}"))
        assert text.endswith(dec([eos], skip_special_tokens=False)) != skip


def test_logprobs_are_of_the_chosen_tokens(engine, prompts):
    tokens, chunks = [], []
    for out in engine.generate(prompts[1], SamplingParams(max_tokens=6, logprobs=2), request_id="lp"):
        tokens += out.new_token_ids
        chunks += out.new_logprobs
    assert [lp.token_id for lp in chunks] == tokens
    for lp in chunks:  # greedy: the chosen token is the top alternative
        assert lp.top[0][0] == lp.token_id and lp.logprob <= 0 and len(lp.top) == 2


def test_requests_that_cannot_fit_are_refused(engine):
    with pytest.raises(RequestError, match="maximum context length"):
        engine.add_request("too-long", [1] * 2000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(RequestError):
        SamplingParams(temperature=-1)


def test_logit_bias_steers_and_bans_tokens(engine, prompts):
    """OpenAI's logit_bias: -100 bans a token, +100 forces it; ids outside the vocabulary and
    values outside [-100, 100] are refused."""
    plain = run_one(engine, prompts[0], SamplingParams(max_tokens=4))[0]
    banned = run_one(engine, prompts[0], SamplingParams(max_tokens=4, logit_bias=((plain[0], -100.0),)))[0]
    assert banned[0] != plain[0] and plain[0] not in banned
    assert run_one(engine, prompts[0], SamplingParams(max_tokens=3, logit_bias=((1234, 100.0),)))[0] == [1234] * 3
    with pytest.raises(RequestError, match=r"logit_bias: token id 1000000 is outside the vocabulary \[0, 49152\)"):
        engine.add_request("lb", prompts[0], SamplingParams(max_tokens=2, logit_bias=((10**6, 1.0),)))
    with pytest.raises(RequestError, match="stop_token_ids: token id -5 is outside"):
        engine.add_request("st", prompts[0], SamplingParams(max_tokens=2, stop_token_ids=(2, -5)))
    with pytest.raises(RequestError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias=((5, 101.0),))


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_incremental_detokenizer_equals_a_full_decode(name):
    """The detokenizer decodes token by token (the tokenizers library's DecodeStream); at every
    step its text is what decoding all ids at once gives, split characters and special tokens
    included, with skip_special_tokens on and off."""
    from specserve.engine.detokenizer import IncrementalDetokenizer
    from specserve.models.loader import load_tokenizer

    tok = load_tokenizer(name)
    text = "def f(x):\n    return x ** 2  # ünïcödé 数学 🙂🚀 \t end"
    special = sorted(tok.eos_token_ids)[:1]
    ids = tok.encode(text, add_special_tokens=False) + special + tok.encode(" again", add_special_tokens=False)
    ids += [i for i in tok.encode("🙂", add_special_tokens=False)][:1]  # ends inside a character
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, [], (), skip_special=skip)
        for n, t in enumerate(ids, 1):
            d.add(t)
            full = tok.decode(ids[:n], skip_special_tokens=skip)
            if not full.endswith("\ufffd"):
                assert d.text == full, (n, d.text, full)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_token_bytes_join_into_the_text(name):
    """Each token's own bytes (logprobs' "bytes"), joined, are the text's UTF-8, also where a token
    holds part of a character and decodes alone to U+FFFD (byte-level BPE; SentencePiece's byte
    fallback); a special token's bytes are its text."""
    from specserve.models.loader import load_tokenizer

    tok = load_tokenizer(name)
    text = "Hé 🐉 dragons 数学 𝔘nicode\t ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # split characters: the case in question
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    # /tokenize's with_pieces, as llama-server: a piece that is not whole characters comes as its bytes
    from specserve.server.app import _piece

    pieces = [_piece(tok.token_bytes(i)) for i in ids]
    assert any(isinstance(p, list) for p in pieces)
    assert b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces) == text.encode()
    end = sorted(tok.eos_token_ids)[0]
    assert tok.token_bytes(end) == tok.id_to_token(end).encode()
    every = tok.all_token_bytes()  # the one-pass vocabulary a grammar engine reads: the same bytes
    sample = [*ids, end, *range(0, tok.vocab_size, tok.vocab_size // 150)]
    assert len(every) == tok.vocab_size and all(every[i] == tok.token_bytes(i) for i in sample)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_encode_plain_reads_special_tokens_as_text(name):
    """llama-server's parse_special false: a special token's spelling is plain text, tokenized as the
    characters it is; the shared encoder still reads it as the token afterwards."""
    from specserve.models.loader import load_tokenizer

    tok = load_tokenizer(name)
    end = tok.id_to_token(min(tok.eos_token_ids))
    text = f"a{end}b"
    plain = tok.encode_plain(text)
    assert min(tok.eos_token_ids) not in plain and tok.decode(plain, skip_special_tokens=False) == text
    assert min(tok.eos_token_ids) in tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name, ends", [("smollm2-135m", {"<|endoftext|>", "<|im_end|>"}),
                                        ("qwen2.5-coder-0.5b", {"<|endoftext|>", "<|im_end|>"}),
                                        ("gemma3-270m", {"<eos>", "<end_of_turn>"})])
def test_end_tokens_are_the_special_ones(name, ends):
    """A generation ends on the EOS and the special end-of-turn tokens only: "</s>" is ordinary text
    (an HTML tag) in Qwen2.5's and Gemma 3's vocabularies, and a strike-through must not stop a reply."""
    from specserve.models.loader import load_tokenizer

    tok = load_tokenizer(name)
    assert {tok.id_to_token(i) for i in tok.eos_token_ids} == ends
    ids = tok.encode("<s>old</s> new", add_special_tokens=False)
    assert not set(ids) & tok.eos_token_ids and tok.decode(ids) == "<s>old</s> new"
