"""What the hybrid (Qwen3.5 / Qwen3-Next) test modules share: the committed tiny checkpoint (ours
and transformers' model over the same files), random prompts, an engine and its greedy outputs,
a drafter that knows the true continuation, and a writable copy of the checkpoint."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
import transformers

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models.loader import load_model
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.drafter import Drafter, Proposal
from specserve.kernels import ops
from tiny_models import FP32

RTOL = 1e-4


DATA = Path(__file__).resolve().parent / "data" / "tiny_qwen35"  # made by tests/data/make_tiny_qwen35.py
LLAMA_CPP = json.loads((DATA / "llama_cpp_tokens.json").read_text())


def load_hybrid():
    """The committed tiny checkpoint (tests/tiny_models.make_tiny_hybrid, mtp.* included): ours and
    transformers' Qwen3_5ForCausalLM over the same files."""
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(DATA / "hf"), dtype=torch.float32).eval()
    return load_model(str(DATA / "hf"), FP32), hf


def random_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def make_engine(model, spec=None, drafter=None, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    return LLMEngine(model, EngineConfig(**kw), spec, drafter)


def greedy_outputs(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    return [got[f"r{i}"] for i in range(len(prompts))]


class OracleDrafter(Drafter):
    """Proposes a random number of the true greedy continuation's next tokens, then random ones:
    every accepted count from 0 to k occurs, so every snapshot plane gets rolled back to."""

    name = "oracle"

    def __init__(self, truth: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.truth, self.rnd = truth, random.Random(seed)

    def propose(self, seqs, num_tokens):
        out = []
        for seq, k in zip(seqs, num_tokens):
            cont = self.truth.get(tuple(seq.prompt_ids), [])[len(seq.output_ids):]
            good = self.rnd.randrange(k + 1)
            out.append(Proposal(cont[:good] + [self.rnd.randrange(256) for _ in range(k - min(good, len(cont)))]))
        return out


def repetitive(seed: int) -> list[int]:
    rnd = random.Random(seed)
    unit = [rnd.randrange(256) for _ in range(rnd.randrange(3, 7))]
    return (unit * 12)[:rnd.randrange(20, 60)]


def copy_checkpoint(hybrid, tmp_path):
    src = hybrid[0].resolved.path
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst, json.loads((dst / "config.json").read_text())


def check_matches_transformers(ours, hf, seed: int) -> None:
    """A prompt's logits at every position (one forward) as transformers' within RTOL, and greedy
    tokens as its generate (which stops at the eos token; we ignore it)."""
    ids = random_prompt(seed, 40)
    eng = make_engine(ours)
    eng.add_request("a", ids, SamplingParams(max_tokens=1))
    eng.scheduler.admit()
    rows = eng.scheduler.schedule(drafting=False)
    batch = eng.runner.batch(rows)
    batch.logits_indices = torch.arange(len(ids))
    got = ours.model.forward(batch, eng.kv).logits
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert float(ref.abs().max()) > 1.0 and (got - ref).abs().max() <= RTOL * ref.abs().max()
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False)[0, len(ids):]
    want = want.tolist()
    assert len(want) >= 8 and greedy_outputs(make_engine(ours), [ids], 32)[0][:len(want)] == want


def check_lossless_with_oracle_and_mtp(ours, seed: int) -> None:
    """Greedy speculation equals plain greedy, 4 sequences batched: an oracle drafter with chunked
    prefill (16-token steps), and the checkpoint's own MTP head, both at a fixed draft length."""
    from specserve.speculative.mtp import MTPDrafter

    prompts = [random_prompt(seed + s, 25 + 11 * s) for s in range(4)]
    plain = greedy_outputs(make_engine(ours, max_num_seqs=4), prompts, 24)
    truth = {tuple(p): out for p, out in zip(prompts, plain)}
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False)
    eng = make_engine(ours, spec, OracleDrafter(truth), max_num_seqs=4, max_num_batched_tokens=16, max_step_ms=0)
    assert greedy_outputs(eng, prompts, 24) == plain
    assert eng.totals.accepted_tokens > 0 and eng.cache.idle()
    mtp = make_engine(ours, SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False),
                      MTPDrafter.load(None, ours), max_num_seqs=4)
    assert greedy_outputs(mtp, prompts, 24) == plain and mtp.totals.draft_tokens > 0


def llama_cpp_partings(ours, name: str, plain: list[list[int]]) -> tuple[int, list[tuple]]:
    """Our greedy tokens ``plain`` (one list per prompt of LLAMA_CPP) against native llama-server's on
    GGUF ``name``: the tokens equal before each prompt's paths part, summed, and per parting (the
    tokens before it, ours, llama-server's, our logit of ours less our logit of its, our largest logit)."""
    from engine_utils import logits_of_every_position

    same, partings = 0, []
    for prompt, got, want in zip(LLAMA_CPP["prompts"], plain, LLAMA_CPP["files"][name]):
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        same += i
        if i < len(want):
            eng = make_engine(ours)
            eng.add_request("t", prompt + got[:i], SamplingParams(max_tokens=1))
            last = logits_of_every_position(eng, "t")[0][len(prompt) + i - 1]
            partings.append((i, prompt + got[:i], got[i], want[i], float(last[got[i]] - last[want[i]]),
                             float(last.max())))
    return same, partings


# ---- the fused C path of hybrid models against their per-op Python path ----------------------
def traced(monkeypatch, lm, fused: bool, run) -> tuple[list[torch.Tensor], object, int]:
    """run() with the model's fused path on or off -> (every forward's logits, run's result, how
    many forwards ran their layers through the C stack)."""
    model, forwards, stacked = lm.model, [], []
    forward, layers_call = model.forward, ops.hybrid_layers

    def record(batch, kv):
        out = forward(batch, kv)
        forwards.append(out.logits.clone())
        return out

    def count(*a):
        stacked.append(len(forwards))
        return layers_call(*a)

    monkeypatch.setattr(model, "forward", record)
    monkeypatch.setattr(ops, "hybrid_layers", count)
    model.fused = fused
    try:
        result = run()
    finally:
        model.fused = True
        monkeypatch.undo()
    return forwards, result, len(set(stacked))


def assert_same_bits(monkeypatch, lm, run) -> object:
    """run() fused and on the Python path: the same logits in every forward, every forward fused."""
    py, want, none = traced(monkeypatch, lm, False, run)
    fused, got, stacked = traced(monkeypatch, lm, True, run)
    assert none == 0 and stacked == len(fused) == len(py) > 0
    assert all(torch.equal(a, b) for a, b in zip(py, fused))
    assert got == want
    return got
