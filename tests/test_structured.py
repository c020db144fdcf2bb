"""Structured outputs on the real engine (smollm2-135m): every output matches its schema or regex,
and greedy speculation under a grammar is token for token greedy without it, for each drafter.

The 50 schemas and 20 regexes of specserve.bench.structured_cases run plain; n-gram speculation
runs every second case, draft-model and DFlash speculation every fifth (benchmarks/structured.py
runs the whole set with every drafter).
"""

from __future__ import annotations

import itertools

import pytest

from engine_utils import make_engine
from specserve.bench.structured_cases import cases, run_cases, valid
from specserve.engine.constraint import ConstraintSpec
from specserve.engine.types import SamplingParams
from specserve.server.structured import build_tokenizer, compile_grammar, grammar_source

pytestmark = pytest.mark.slow

MAX_TOKENS = 96
CASES = cases()
HALF, SUBSET = CASES[::2], CASES[::5]
SPECS = {
    # prompt_lookup_min 1: the n-gram drafter proposes often, and the grammar cuts many proposals
    "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false, "prompt_lookup_min": 1, '
             '"prompt_lookup_max": 3}',
    "draft_model": '{"method": "draft_model", "model": "smollm2-135m", "quantization": "int8", '
                   '"num_speculative_tokens": 4, "adaptive": false}',
    "dflash": '{"method": "dflash", "model": "smollm2-135m-dflash", "num_speculative_tokens": 7, "adaptive": false}',
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def plain():
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "8")
    lltok, _ = build_tokenizer(engine.tokenizer)
    return engine, lltok, run_cases(engine, lltok, CASES, SamplingParams(max_tokens=MAX_TOKENS))


def test_every_output_matches_its_schema_or_regex(plain):
    engine, _, results = plain
    bad = []
    for (kind, name, _, value), (toks, finish) in zip(CASES, results):
        text = engine.tokenizer.decode(toks)
        if finish != "stop" or not valid(kind, value, text):
            bad.append(f"{name}: {finish} {text!r}")
    assert not bad, "\n".join(bad)
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_speculation_under_a_grammar_equals_plain(plain, method):
    _, lltok, results = plain
    cases, want = (HALF, results[::2]) if method == "ngram" else (SUBSET, results[::5])
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "8", "--speculative-config", SPECS[method])
    got = run_cases(engine, lltok, cases, SamplingParams(max_tokens=MAX_TOKENS))
    for (_, name, _, _), (a, _), (b, _) in zip(cases, want, got):
        assert a == b, f"{name}: {engine.tokenizer.decode(a)!r} != {engine.tokenizer.decode(b)!r}"
    assert engine.totals.draft_tokens > 0 and engine.totals.accepted_tokens > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_sampled_outputs_under_speculation_match_their_schemas(plain):
    """Temperature 0.8, seeded, with a draft model: every accepted, recovered and bonus token is
    legal, so every output still matches (exactness itself: tests/test_constraint.py)."""
    _, lltok, _ = plain
    engine = make_engine("--model", "smollm2-135m", "--max-num-seqs", "8", "--speculative-config",
                         SPECS["draft_model"])
    got = run_cases(engine, lltok, SUBSET, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7))
    bad = [f"{name}: {finish} {engine.tokenizer.decode(t)!r}" for (kind, name, _, value), (t, finish)
           in zip(SUBSET, got) if finish != "stop" or not valid(kind, value, engine.tokenizer.decode(t))]
    assert not bad, "\n".join(bad)
    assert engine.totals.accepted_tokens > 0


REASONING_PROMPT = ("<think>\nThe user wants a number.\n</think>\n{\"n\": 1}\n"
                    "<think>\nAnother number.\n</think>\n{\"n\": 2}\n"
                    "<think>\nOne more.\n")


@pytest.mark.parametrize("spec", [None, SPECS["ngram"]])
def test_the_grammar_starts_after_the_reasoning(plain, spec):
    """start "after_think": free text until the output closes </think>, the schema after it."""
    _, lltok, _ = plain
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    grammar = compile_grammar(lltok, grammar_source("json", schema).grammar)
    args = ["--model", "smollm2-135m"] + (["--speculative-config", spec] if spec else [])
    engine = make_engine(*args)
    ids = engine.tokenizer.encode(REASONING_PROMPT)
    params = SamplingParams(max_tokens=40, structured=ConstraintSpec(grammar, "after_think"))
    toks = [t for out in engine.generate(ids, params, f"t{next(_ids)}") for t in out.new_token_ids]
    text = engine.tokenizer.decode(toks)
    assert "</think>" in text, text
    answer = text.split("</think>", 1)[1]
    assert valid("json", schema, answer.strip()), text
    free = [t for out in plain[0].generate(ids, SamplingParams(max_tokens=40), f"t{next(_ids)}")
            for t in out.new_token_ids]
    reasoning = text.split("</think>", 1)[0] + "</think>"
    assert engine.tokenizer.decode(free).startswith(reasoning)  # the reasoning itself is not constrained


def test_forced_tool_calls_use_the_tokenizers_own_tag_tokens():
    """qwen's <tool_call> is a special token: llguidance's mask offers it for the text
    "<tool_call>" but its matcher refuses it, so the tool grammar names the token itself. The
    sequence a model writes (tag token, JSON, tag token, end) is legal from start to end."""
    from types import SimpleNamespace

    from specserve.engine.constraint import Constraint
    from specserve.models.loader import load_tokenizer
    from specserve.server.structured import LITERAL_TAGS, requested_source, tag_terms
    from specserve.server.tools import plan_tools

    tok = load_tokenizer("qwen2.5-coder-0.5b")
    lltok, _ = build_tokenizer(tok)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    plan = plan_tools(tools, "required", None, "hermes")
    req = SimpleNamespace(model_extra={}, response_format=None)
    open_id, close_id = (tok.backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>"))
    written = [open_id, *tok.backend.encode('\n{"name": "f", "arguments": {"x": 3}}\n',
                                            add_special_tokens=False).ids, close_id, min(tok.eos_token_ids)]
    terms = tag_terms(tok.backend, lltok)
    assert terms == (f"<[{open_id}]>", f"<[{close_id}]>")
    legal = {}
    for name, tags in (("tokens", terms), ("text", LITERAL_TAGS)):
        grammar = compile_grammar(lltok, requested_source(req, plan, tags).grammar)
        legal[name] = Constraint(ConstraintSpec(grammar)).legal_prefix(written)
    assert legal["tokens"] == len(written)
    assert legal["text"] < len(written)  # what the tags as text did: the call could not be written


def test_forced_tool_call_arguments_take_only_the_functions_keys():
    """A forced call's arguments are closed objects: a key from another tool's parameters (or any
    key the function does not list) is never legal, so the call cannot break the function it names."""
    from types import SimpleNamespace

    from specserve.engine.constraint import Constraint
    from specserve.models.loader import load_tokenizer
    from specserve.server.structured import requested_source, tag_terms
    from specserve.server.tools import plan_tools

    tok = load_tokenizer("qwen2.5-coder-0.5b")
    lltok, _ = build_tokenizer(tok)
    city = {"city": {"type": "string"}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": city, "required": ["city"]}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {**city, "tz": {"type": "integer"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "now"}},
             {"type": "function", "function": {"name": "open_file", "parameters": {  # Pydantic's Path
                 "type": "object", "properties": {"path": {"type": "string", "format": "path"}}}}}]
    req = SimpleNamespace(model_extra={}, response_format=None)
    grammar = compile_grammar(lltok, requested_source(req, plan_tools(tools, "required", None, "hermes"),
                                                      tag_terms(tok.backend, lltok)).grammar)
    open_id, close_id = (tok.backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>"))

    def legal(call: str) -> bool:
        written = [open_id, *tok.backend.encode(f"\n{call}\n", add_special_tokens=False).ids, close_id]
        return Constraint(ConstraintSpec(grammar)).legal_prefix(written) == len(written)

    assert legal('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert legal('{"name": "get_time", "arguments": {"city": "Paris", "tz": 1}}')
    assert legal('{"name": "now", "arguments": {}}')
    assert not legal('{"name": "get_weather", "arguments": {"city": "Paris", "tz": 1}}')
    assert not legal('{"name": "get_weather", "arguments": {"city": "Paris", "city2": "London"}}')
    assert not legal('{"name": "now", "arguments": {"x": 1}}')
    assert legal('{"name": "open_file", "arguments": {"path": "/tmp/a.txt"}}')  # a format llguidance lacks: text
