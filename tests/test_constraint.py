"""The grammar state of a sequence (engine/constraint.py) and exact sampling under a mask.

Masks for the rows of a block equal those of a matcher advanced token by token from the start;
drafts are cut at the first token the grammar rejects; a reasoning block is free until
``</think>``; and rejection sampling with the mask on target and draft keeps the masked target
distribution exactly (while cutting an unmasked draft does not).
"""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specserve.engine import sampler
from specserve.engine.constraint import Constraint, ConstraintSpec, cut_proposal, unpack_bitmask
from specserve.engine.sampler import make_generator, sample_from
from specserve.engine.sequence import Sequence
from specserve.engine.types import SamplingParams
from specserve.models.loader import load_tokenizer
from specserve.server.structured import build_tokenizer, compile_grammar, grammar_source
from specserve.speculative.drafter import Proposal, pick_tokens
from specserve.speculative.verify import verify_sampling

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
TEXT = '{"name": "Bob", "n": 42}'


@pytest.fixture(scope="module")
def smol():
    tok = load_tokenizer("smollm2-135m")
    lltok, _ = build_tokenizer(tok)
    return tok, lltok


def spec(lltok, kind="json", value=SCHEMA, start="now", think_open=()):
    grammar = compile_grammar(lltok, grammar_source(kind, value).grammar)
    assert not isinstance(grammar, str), grammar
    return ConstraintSpec(grammar, start, think_open)


def fresh_mask(spec_, tokens, width):
    """The mask after ``tokens`` from a matcher advanced one token at a time from the start."""
    m = spec_.grammar.matcher.deep_copy()
    assert m.consume_tokens(tokens) if tokens else True
    bits = torch.zeros((spec_.grammar.tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
    mask = torch.zeros(width, dtype=torch.bool)
    vocab = spec_.grammar.tokenizer.vocab_size
    mask[:vocab] = unpack_bitmask(bits, vocab)
    return mask


def test_unpack_bitmask_order():
    bits = torch.tensor([0b101, -2 ** 31], dtype=torch.int32)  # tokens 0, 2 and 63
    assert unpack_bitmask(bits, 64).nonzero().flatten().tolist() == [0, 2, 63]
    assert unpack_bitmask(bits, 40).shape == (40,)


def test_row_masks_equal_a_matcher_advanced_from_the_start(smol):
    tok, lltok = smol
    sp = spec(lltok)
    ids = tok.encode(TEXT)
    V = tok.vocab_size + 64  # logits wider than the tokenizer: the padding ids are never allowed
    c = Constraint(sp)
    c.commit(ids[:3])
    rows = c.masks(ids[3:8], V)
    assert rows.shape == (6, V) and not rows[:, tok.vocab_size:].any()
    for j in range(6):
        assert torch.equal(rows[j], fresh_mask(sp, ids[:3 + j], V)), j
    # a shorter block after a longer one (verification kept 2 drafts): the stack rolls back
    assert torch.equal(c.masks(ids[3:5], V)[-1], fresh_mask(sp, ids[:5], V))
    c.commit(ids[3:6])
    assert torch.equal(c.mask_after([], V), fresh_mask(sp, ids[:6], V))
    c.commit(ids[6:])
    end = c.mask_after([], V).nonzero().flatten().tolist()
    assert end == sorted(tok.eos_token_ids)  # the JSON value is complete: only an end token
    c.commit([end[0]])
    assert not c.broken


def test_rolling_back_over_an_end_token(smol):
    """Drafts that end the value and then the request ("}", EOS), rejected after "4": the state
    after the token verification put there instead is exact (llguidance does not count an EOS in
    its rollback, so the EOS never reaches its matcher)."""
    tok, lltok = smol
    sp = spec(lltok)
    V = tok.vocab_size
    head = tok.encode('{"name": "Bob", "n": 4')
    eos = sorted(tok.eos_token_ids)[0]
    c = Constraint(sp)
    c.commit(head)
    rows = c.masks(tok.encode("}") + [eos], V)
    assert rows[2].nonzero().flatten().tolist() == sorted(tok.eos_token_ids)  # after EOS: only an end
    two = tok.encode("2")
    c.commit(two)
    assert not c.broken and torch.equal(c.mask_after([], V), fresh_mask(sp, head + two, V))


def test_drafts_are_cut_at_the_first_illegal_token(smol):
    tok, lltok = smol
    c = Constraint(spec(lltok))
    good = tok.encode('{"name": "Al')
    head = tok.encode('{"name": ')
    bad = head + tok.encode("7") + tok.encode('"')  # a number where a string must be
    assert c.legal_prefix(good) == len(good)
    assert c.legal_prefix(bad) == len(head)
    seq = Sequence("s", [1], SamplingParams(), None)
    seq.constraint = c
    prop = cut_proposal(seq, Proposal(bad, torch.rand(len(bad), 8)))
    assert prop.token_ids == head and prop.probs.shape[0] == len(head) and prop.cut
    whole = cut_proposal(seq, Proposal(good))
    assert whole.token_ids == good and not whole.cut
    with pytest.raises(ValueError):
        c.mask_after(bad, tok.vocab_size)


def test_reasoning_is_free_until_think_closes(smol):
    tok, lltok = smol
    c = Constraint(spec(lltok, start="after_think"))
    V = tok.vocab_size
    thought = tok.encode("hmm, let me see </thi")
    assert c.masks(thought, V) is None  # no row constrained
    rest = tok.encode("nk>")
    rows = c.masks(thought + rest, V)
    assert rows[:-1].all()  # reasoning rows: anything
    assert rows[-1].nonzero().flatten().tolist() == tok.encode('{"')  # after </think>: the grammar
    c.commit(thought + rest + tok.encode('{"'))
    assert torch.equal(c.mask_after([], V), fresh_mask(spec(lltok), tok.encode('{"'), V))


def test_maybe_think_allows_an_opening_token_or_the_grammar(smol):
    tok, lltok = smol
    open_id = tok.encode("<|im_start|>")[0]  # stands in for a <think> token
    c = Constraint(spec(lltok, start="maybe_think", think_open=(open_id,)))
    V = tok.vocab_size
    first = c.mask_after([], V)
    assert first.nonzero().flatten().tolist() == sorted([open_id, *tok.encode('{"')])
    assert c.mask_after([open_id], V) is None  # opened: reasoning
    c.commit(tok.encode('{"'))  # not opened: the grammar from the first token
    assert not c.mask_after([], V)[open_id]


def test_min_tokens_gives_way_where_the_grammar_only_ends():
    logits = torch.zeros(2, 4)
    allowed = torch.tensor([[True, True, False, False], [False, False, False, True]])
    p = SamplingParams(min_tokens=5, eos_token_ids=(3,))
    out = sampler.penalize(logits, p, [0], [], [1], allowed)
    assert out[0].tolist() == [0, 0, float("-inf"), float("-inf")]
    assert out[1].tolist() == [float("-inf")] * 3 + [0]  # only the end is legal: min_tokens yields


# ---------------------------------------------------------------- exactness under a mask

V = 6  # tokens a b c d e <eos>
P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])  # target, every row
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])  # draft, every row: much mass on illegal tokens
REGEX = "(a[a-e]|b[de]|c[ab])"  # the second token's mask depends on the first


@pytest.fixture(scope="module")
def tiny():
    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcde")} | {"<eos>": 5}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(["<eos>"])
    import llguidance

    lltok = llguidance.LLTokenizer(bpe.to_str(), n_vocab=V, eos_token=5)
    return spec(lltok, "regex", REGEX)


def masked(p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = p * mask
    return out / out.sum()


def exact_joint(sp) -> dict[tuple[int, int], float]:
    """P(first, second) of the masked target: row 0 masked at the start, row 1 after the first."""
    c = Constraint(sp)
    p0 = masked(P, c.mask_after([], V))
    return {(a, b): float(p0[a] * masked(P, c.mask_after([a], V))[b])
            for a in range(V) if p0[a] > 0 for b in range(V) if c.mask_after([a], V)[b]}


def draw(sp, n: int, seed: int, mask_draft: bool) -> dict[tuple[int, int], int]:
    """Two tokens per step: one draft (picked by pick_tokens, masked or not) verified against the
    masked target, then the bonus or recovered token, as the engine does."""
    g = make_generator(seed)
    params = SamplingParams(temperature=1.0)
    logits_t = torch.log(P).expand(2, V)
    counts: dict[tuple[int, int], int] = {}
    seq = Sequence("s", [0], params, None)
    seq.constraint = Constraint(sp)  # never committed: every step starts from the grammar's start
    for _ in range(n):
        if mask_draft:
            prop = pick_tokens(seq, torch.log(Q)[None], g)
        else:  # the wrong way: sample from the unmasked draft, then cut at an illegal token
            prop = Proposal([sample_from(Q, g)], Q[None].clone())
        prop = cut_proposal(seq, prop)
        allowed = seq.constraint.masks(prop.token_ids, V)
        lg = sampler.penalize(logits_t[:1 + len(prop.token_ids)], params, [0], [], prop.token_ids, allowed)
        _, toks = verify_sampling(sampler.probs_from_logits(lg, params), prop.token_ids, prop.probs, g)
        if len(toks) == 1:  # the draft was rejected or cut: the second token from the masked row 1
            row = sampler.penalize(torch.log(P)[None], params, [0], toks, (), seq.constraint.mask_after(toks, V)[None])
            toks.append(sample_from(sampler.probs_from_logits(row, params)[0], g))
        key = (toks[0], toks[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi2_pvalue(counts: dict, probs: dict) -> float:
    n = sum(counts.values())
    assert set(counts) <= set(probs)  # no illegal pair ever
    stat = sum((counts.get(k, 0) - p * n) ** 2 / (p * n) for k, p in probs.items())
    df = torch.tensor(float(len(probs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, torch.tensor(stat, dtype=torch.float64) / 2))


def test_masked_draft_and_target_keep_the_masked_target_distribution(tiny):
    assert chi2_pvalue(draw(tiny, 4000, seed=1, mask_draft=True), exact_joint(tiny)) > 0.001


def test_the_test_catches_a_draft_that_is_cut_instead_of_masked(tiny):
    """An unmasked draft cut at its first illegal token is not distributed as its q any more: the
    first token is "a" with probability 0.31 instead of 0.40 here (10 standard deviations at n)."""
    assert chi2_pvalue(draw(tiny, 4000, seed=2, mask_draft=False), exact_joint(tiny)) < 0.001


def test_greedy_drafts_follow_the_grammar(tiny):
    """Greedy drafting picks the best token the grammar allows after each earlier draft."""
    seq = Sequence("s", [0], SamplingParams(), None)
    seq.constraint = Constraint(tiny)
    logits = torch.log(Q).expand(3, V)  # unmasked argmax: "c" (2), then "c" again
    prop = pick_tokens(seq, logits, None)
    assert prop.token_ids == [2, 1, 5]  # "c", the better of {a, b}: "b", then only the end


# ---------------------------------------------------------------- request fields (server/structured.py)

def structured_request(**fields):
    from specserve.server.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_request_fields_compile_once_and_are_cached(smol):
    import asyncio

    from specserve.server.structured import StructuredOutputs

    tok, _ = smol
    so = StructuredOutputs(tok, timeout_s=30)

    async def run():
        a = await so.spec_for(structured_request(guided_json=SCHEMA))
        b = await so.spec_for(structured_request(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": SCHEMA, "strict": True}}))
        c = await so.spec_for(structured_request(structured_outputs={"regex": "[0-9]{3}"}), start="after_think")
        none = await so.spec_for(structured_request(response_format={"type": "text"}))
        return a, b, c, none

    a, b, c, none = asyncio.run(run())
    assert a.grammar is b.grammar  # the same schema: one compile
    assert c.start == "after_think" and c.grammar is not a.grammar and none is None
    so.close()


@pytest.mark.parametrize("fields,param,words", [
    ({"guided_json": {"type": "array", "uniqueItems": True, "contains": {"type": "integer"}}}, "guided_json",
     ["unsupported JSON Schema keywords", "uniqueItems", "contains"]),
    ({"structured_outputs": {"json": {"type": "object", "dependentRequired": {"a": ["b"]}}}},
     "structured_outputs.json", ["dependentRequired"]),
    ({"guided_regex": "(a"}, "guided_regex", ["invalid regex"]),
    ({"guided_json": "{not json"}, "guided_json", ["not valid JSON"]),
    ({"guided_choice": ["a", 5]}, "guided_choice", ["list of non-empty strings"]),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", ["exactly one"]),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", ["both constrain"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "response_format.json_schema.schema", ["JSON Schema"]),
])
def test_bad_constraints_name_the_field(smol, fields, param, words):
    import asyncio

    from specserve.errors import RequestError
    from specserve.server.structured import StructuredOutputs

    so = StructuredOutputs(smol[0], timeout_s=30)
    with pytest.raises(RequestError) as info:
        asyncio.run(so.spec_for(structured_request(**fields)))
    assert info.value.param == param and all(w in str(info.value) for w in words), str(info.value)
    so.close()


def test_a_compile_past_the_time_limit_is_refused_then_cached(smol):
    """A schema that takes seconds to compile: the request waits 0.05 s and gets a 400; the compile
    runs on in its worker and caches the grammar, which a later request then gets at once."""
    import asyncio
    import time

    from specserve.errors import RequestError
    from specserve.server.structured import StructuredOutputs

    slow = {"type": "object", "properties": {
        f"p{i}": {"anyOf": [{"type": "integer", "minimum": i, "maximum": 7 * i + 3},
                            {"type": "string", "maxLength": i % 30 + 1}]} for i in range(5000)}}
    so = StructuredOutputs(smol[0], timeout_s=0.05)

    async def run():
        with pytest.raises(RequestError) as info:
            await so.spec_for(structured_request(guided_json=slow))
        assert "took longer than 0.05 s" in str(info.value) and info.value.param == "guided_json"
        so.timeout_s = 60  # a busy machine must not fail what follows
        quick = await so.spec_for(structured_request(guided_regex="[ab]"))  # the other worker serves
        deadline = time.monotonic() + 600
        while so._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return quick, await so.spec_for(structured_request(guided_json=slow))

    quick, later = asyncio.run(run())
    assert quick is not None and later is not None
    so.close()


@pytest.mark.parametrize("model,spelled", [("smollm2-135m", "<|im_start|>"), ("qwen2.5-coder-0.5b", "<tool_call>")])
def test_forced_text_spelling_a_special_token_is_written_as_text(model, spelled):
    """A regex that forces the characters of an added token: the mask offers the characters' tokens
    (never the token itself, which the matcher refuses), and they lead to the end of the grammar."""
    tok = load_tokenizer(model)
    lltok, _ = build_tokenizer(tok)
    special = tok.backend.token_to_id(spelled)
    c = Constraint(spec(lltok, "regex", "A" + spelled.replace("|", "\\|") + "B"))
    text = tok.text_only().encode(spelled + "B", add_special_tokens=False).ids
    assert special not in text and c.legal_prefix(tok.encode("A") + text) == len(tok.encode("A") + text)
    mask = c.mask_after(tok.encode("A"), tok.vocab_size)
    assert not mask[special] and mask[text[0]]
    c.commit(tok.encode("A") + text)
    assert not c.broken and bool(c.mask_after([], tok.vocab_size)[min(tok.eos_token_ids)])
