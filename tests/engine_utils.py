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


def logits_of_every_position(eng: LLMEngine, request_id: str):
    """Run an added request alone to its end, its prompt in one forward: the logits of every prompt
    position and of each decode step, [len(prompt) + steps - 1, V], and its sequence."""
    import torch

    seq = eng.by_id[request_id]
    eng.scheduler.admit()
    if eng.runner.encoder is not None:
        eng.encode_ahead()  # (what a step does first: the prompt's images)
    rows = eng.scheduler.schedule(drafting=False)
    assert rows[0].count == len(seq.prompt_ids)
    batch = eng.runner.batch(rows)
    batch.logits_indices = torch.arange(len(seq.prompt_ids))
    got = [eng.model.forward(batch, eng.kv).logits]
    eng._process(rows, got[0][-1:], {})
    while eng.has_work():
        rows = eng.scheduler.schedule(drafting=False)
        out = eng.runner.run(rows)
        got.append(out.logits)
        eng._process(rows, out.logits, {})
    return torch.cat(got), seq


def drafter_makers(checkpoint: Path, target, draft, max_len: int) -> dict:
    """method -> a function making (SpeculativeConfig, drafter) for target (loaded from checkpoint,
    which carries mtp.* tensors); draft: a draft model sharing the vocabulary; dflash: a random one."""
    from specserve.models.loader import LoadOptions, load_model
    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.dflash import DFlashConfig, DFlashDrafter, DFlashModel
    from specserve.speculative.draft_model import DraftModelDrafter
    from specserve.speculative.mtp import MTPDrafter
    from specserve.speculative.ngram import NgramDrafter
    from specserve.speculative.suffix import SuffixDrafter

    def dflash():
        m = DFlashModel(DFlashConfig.for_target(target, num_layers=1, block_size=4))
        m.init_weights(1.0, target.model.final_norm, 0)
        return SpeculativeConfig("dflash", num_speculative_tokens=3, adaptive=False, model="x"), DFlashDrafter(m, target)

    fp32 = LoadOptions(device="cpu", quantization="none")
    return {
        "ngram": lambda: (SpeculativeConfig("ngram", num_speculative_tokens=4), NgramDrafter(1, 3)),
        "suffix": lambda: (SpeculativeConfig("suffix", num_speculative_tokens=3), SuffixDrafter(16, 3)),
        # a fixed k, as mtp and dflash: with the adaptive policy whether a short test drafts at all
        # would depend on the machine's timings
        "draft_model": lambda: (SpeculativeConfig("draft_model", num_speculative_tokens=4, adaptive=False,
                                                  model="x"),
                                DraftModelDrafter(draft, 200, 8, max_len)),
        "mtp": lambda: (SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False),
                        MTPDrafter.load(None, load_model(str(checkpoint), fp32))),
        "dflash": dflash,
    }
