"""What one proposal of a model-based drafter costs, measured inside the engine.

    python benchmarks/drafter_step.py [--model smollm2-135m] [--methods dflash,mtp]
        [--tokens 64] [--prompts 3] [--out step.json]

Greedy decoding of the code suite's first prompts with a fixed draft length (no adaptive
policy), timing every ``propose`` call of the drafter (wall clock, ms): for ``dflash`` the
catalog drafter ``{model}-dflash`` (k = 7), for ``mtp`` an MTP head with random weights at the
target's shapes (what `train-drafter --method mtp` starts from; k = 3), each in its default
weight format; with --mtp-draft-vocab N also the MTP head drafting from the LM head cut to N
tokens (``draft_vocab_size``). Only the drafter's time is reported, so an A/B of two source trees
(PYTHONPATH=tree) compares drafter code alone; the output is checked against plain greedy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.bench.suites import load_suites  # noqa: E402
from specserve.engine.config import EngineConfig  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.models.chat_template import ChatTemplate  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.registry import build_drafter  # noqa: E402


def random_mtp_head(target, out: Path) -> str:
    from specserve.speculative.mtp import MTPConfig, MTPModel

    try:
        from specserve.speculative.drafter_files import save_drafter
    except ImportError:  # (trees before the drafter files had a module of their own)
        from specserve.speculative.dflash import save_drafter
    head = MTPModel(MTPConfig.for_target(target))
    head.init_weights(target.model.final_norm.cpu(), seed=0)
    save_drafter(head, head.cfg.to_json(), out)
    return str(out)


def greedy(eng: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return [[t for o in eng.generate(p, params, request_id=f"r{i}") for t in o.new_token_ids]
            for i, p in enumerate(prompts)]


def measure(target, spec: SpeculativeConfig, prompts: list[list[int]], tokens: int, want) -> dict:
    ecfg = EngineConfig(max_num_seqs=1, max_model_len=2048)
    drafter = build_drafter(spec, target, LoadOptions(), ecfg, ecfg.max_model_len)
    times: list[float] = []
    propose = drafter.propose

    def timed(seqs, ks):
        t0 = time.perf_counter()
        out = propose(seqs, ks)
        times.append(time.perf_counter() - t0)
        return out

    drafter.propose = timed
    eng = LLMEngine(target, ecfg, spec, drafter)
    greedy(eng, prompts[:1], 8)  # warm-up
    times.clear()
    got = greedy(eng, prompts, tokens)
    assert got == want, "decoding with the drafter must equal plain greedy"
    ms = sorted(1000 * t for t in times)
    return {"proposals": len(ms), "k": spec.num_speculative_tokens, "median_ms": round(statistics.median(ms), 3),
            "mean_ms": round(statistics.fmean(ms), 3), "weight_bytes": drafter.weight_bytes()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="dflash,mtp")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--mtp-draft-vocab", type=int, default=0,
                    help="also time the MTP head drafting from the LM head cut to this many tokens")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    target = load_model(a.model)
    tok = target.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    prompts = [tok.encode(template.render(p.as_messages()), add_special_tokens=False)
               for p in load_suites("code", a.prompts)["code"]]
    plain = greedy(LLMEngine(target, EngineConfig(max_num_seqs=1, max_model_len=2048)), prompts, a.tokens)
    report = {"model": a.model}
    with tempfile.TemporaryDirectory() as tmp:
        methods = a.methods.split(",") + (["mtp-vocab"] if a.mtp_draft_vocab else [])
        for method in methods:
            if method == "dflash":
                spec = SpeculativeConfig("dflash", model=f"{a.model}-dflash", num_speculative_tokens=7, adaptive=False)
            else:
                vocab = a.mtp_draft_vocab if method == "mtp-vocab" else None
                spec = SpeculativeConfig("mtp", model=random_mtp_head(target, Path(tmp) / "mtp"),
                                         num_speculative_tokens=3, adaptive=False, draft_vocab_size=vocab)
            report[method] = r = measure(target, spec, prompts, a.tokens, plain)
            print(f"{a.model} {method:9s} k={r['k']}: {r['median_ms']:.2f} ms per proposal (median of "
                  f"{r['proposals']}; mean {r['mean_ms']:.2f}), weights {r['weight_bytes'] / 2**20:.1f} MiB")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
