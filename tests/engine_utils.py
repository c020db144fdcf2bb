"""Helpers for tests that run the real engine."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from specserve.commands.args import add_engine_args
from specserve.engine.builder import build_engine
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models.chat_template import ChatTemplate

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "specserve" / "bench" / "prompts"
_ids = itertools.count()


def make_engine(*argv: str) -> LLMEngine:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return build_engine(p.parse_args(list(argv)))


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    rendered = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token).render(
        [{"role": "user", "content": text}])
    return tok.encode(rendered)


def bench_prompts(per_suite: int) -> list[str]:
    out = []
    for suite in ("code", "math", "prose"):
        lines = (PROMPTS_DIR / f"{suite}.jsonl").read_text().splitlines()[:per_suite]
        for line in lines:
            obj = json.loads(line)
            out.append(obj["messages"][-1]["content"] if "messages" in obj else obj["prompt"])
    return out


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Submit every prompt at once (continuous batching) and collect each one's tokens."""
    rids = [f"r{next(_ids)}" for _ in prompts]
    for rid, ids in zip(rids, prompts):
        engine.add_request(rid, ids, params)
    got: dict[str, list[int]] = {rid: [] for rid in rids}
    done: set[str] = set()
    while len(done) < len(rids):
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                done.add(out.request_id)
    return [got[r] for r in rids]


def run_one(engine: LLMEngine, ids: list[int], params: SamplingParams):
    """Run one request alone; returns (tokens, last output)."""
    toks, last = [], None
    for out in engine.generate(ids, params, request_id=f"r{next(_ids)}"):
        toks += out.new_token_ids
        last = out
    return toks, last
