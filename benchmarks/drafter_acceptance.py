"""Teacher-forced acceptance of a dflash drafter: on the benchmark prompts and per training source.

    python benchmarks/drafter_acceptance.py [--drafter smollm2-135m-dflash] [--tokens 128]
        [--prompts-per-suite 2] [--answers OUT/data/answers.pt --per-source 40] [--out acc.json]

For each sequence the target's own greedy continuation is the label; at anchors spread over the
answer, the drafter proposes a block from the target's real hidden states, and the accepted
length is the number of leading drafts equal to the labels, + 1 (llama.cpp's mean acceptance
length, as `train-drafter` logs it for its validation set). Two sets:

* ``bench``: the benchmark suites' prompts (code, math, prose), the target's greedy answers of
  --tokens tokens (EOS ignored, as in spec_decode.py);
* ``held-out`` (with --answers): the answers `train-drafter --answers-only` saved, restricted to the
  10% validation split train-drafter holds out, grouped by prompt source.

A gap between the two says how far the validation number over-states acceptance on new prompts.

For the bench set the script also decodes each prompt with the drafter in the engine (greedy,
fixed k = block size - 1, float32 drafter, full vocabulary, prefix caching on, each prompt
twice so the second run starts from cached blocks) and checks that every proposal equals the
teacher-forced block at the same anchor: decoding loses nothing against this measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specserve.bench.suites import load_suites  # noqa: E402
from specserve.engine.config import EngineConfig  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.models.catalog import drafter_location  # noqa: E402
from specserve.models.chat_template import ChatTemplate  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.dflash import DFlashDrafter, DFlashModel, load_dflash_model  # noqa: E402
from specserve.speculative.prefix_store import PrefixStore  # noqa: E402
from specserve.speculative.train import data as tdata  # noqa: E402
from specserve.speculative.train.trainer import FrozenTarget, HParams, Trainer, split  # noqa: E402


def bench_answers(target, tokens: int, per_suite: int) -> list[tdata.Answer]:
    tok = target.tokenizer
    ct = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    eng = LLMEngine(target, EngineConfig(max_num_seqs=1, max_model_len=2048))
    out = []
    for suite, prompts in load_suites("code,math,prose", per_suite).items():
        for p in prompts:
            ids = tok.encode(ct.render(p.as_messages()), add_special_tokens=False)
            got: list[int] = []
            for o in eng.generate(ids, SamplingParams(max_tokens=tokens, ignore_eos=True), request_id=p.id):
                got += o.new_token_ids
            out.append(tdata.Answer(ids + got, len(ids), suite))
    return out


@torch.inference_mode()
def teacher_forced_blocks(model: DFlashModel, drafter: DFlashDrafter, target, ids: list[int],
                          anchors: list[int]) -> list[list[int]]:
    """The drafter's greedy block at each anchor from the target's hidden states of ids (full head)."""
    h = tdata.capture_hidden(target, [ids], tuple(drafter.cfg.target_layer_ids))[0]  # [T, k*H]
    a = torch.tensor(anchors)
    emb = drafter.head.embed(torch.tensor(ids)[a])
    out = model.train_forward(h[None], emb[None], a[None])[0, :, 1:]  # [m, B-1, H]
    return drafter.head.logits(out.reshape(-1, out.shape[-1])).argmax(-1).view(len(anchors), -1).tolist()


def decode_check(where: str, target, answers: list[tdata.Answer]) -> dict:
    """Decode every bench answer's prompt twice with the drafter in the engine; compare each
    proposal with the teacher-forced block at its anchor; mean acceptance length in decoding."""
    ecfg = EngineConfig(max_num_seqs=1, max_model_len=2048)
    drafter = DFlashDrafter.load(where, target, weights="float32",
                                 store=PrefixStore(1024, ecfg.block_size))
    k = drafter.cfg.block_size - 1
    eng = LLMEngine(target, ecfg, SpeculativeConfig("dflash", num_speculative_tokens=k, model=where, adaptive=False),
                    drafter)
    log: list[tuple[int, list[int]]] = []
    propose = drafter.propose

    def logged(seqs, ks):
        props = propose(seqs, ks)
        log.extend((s.num_tokens - 1, p.token_ids) for s, p in zip(seqs, props))
        return props

    drafter.propose = logged
    model = load_dflash_model(Path(where), target)  # the teacher-forced reference, float32 as trained
    out: dict[str, dict] = {}
    for run in (1, 2):
        for i, a in enumerate(answers):
            log.clear()
            prompt = a.ids[:a.prompt_len]
            params = SamplingParams(max_tokens=len(a.ids) - a.prompt_len, ignore_eos=True)
            got = [t for o in eng.generate(prompt, params, request_id=f"check-{run}-{i}")
                   for t in o.new_token_ids]
            assert got == a.ids[a.prompt_len:], "decoding with the drafter must equal plain greedy"
            tf = teacher_forced_blocks(model, drafter, target, a.ids, [p for p, _ in log])
            r = out.setdefault(a.source, {"steps": 0, "accepted": 0, "equal_to_teacher_forced": 0})
            for (p, d), t in zip(log, tf):
                lead = 0
                while lead < len(d) and p + 1 + lead < len(a.ids) and d[lead] == a.ids[p + 1 + lead]:
                    lead += 1
                r["steps"] += 1
                r["accepted"] += lead
                r["equal_to_teacher_forced"] += t[:len(d)] == d
    for r in out.values():
        r["mean_acceptance_length"] = round(1 + r["accepted"] / max(r["steps"], 1), 3)
    return out


def held_out(path: Path, per_source: int) -> list[tdata.Answer]:
    """train-drafter's validation split of saved answers (same order and seed as its split)."""
    _, val = split(tdata.trainable(tdata.load_answers(path)), 0.1, 0)
    by: dict[str, list[tdata.Answer]] = {}
    for a in val:
        by.setdefault(a.source, []).append(a)
    return [a for lst in by.values() for a in lst[:per_source]]


def acceptance(model: DFlashModel, target, answers: list[tdata.Answer]) -> dict:
    """Teacher-forced acceptance of the trained (float32) drafter on answers."""
    layers = tuple(model.cfg.target_layer_ids)
    ex = tdata.examples_from_answers(target, answers, layers=layers, final_norm=False)
    cpu = torch.device("cpu")
    tr = Trainer("dflash", model, FrozenTarget.from_target(target, cpu), ex, ex,
                 HParams(batch=8, seq_len=2048, val_anchors=32), Path("/nonexistent"), cpu)
    out = {}
    for source in sorted({e.source for e in ex}):
        ev = tr.evaluate([e for e in ex if e.source == source])
        out[source] = {"sequences": sum(e.source == source for e in ex), "anchors": ev["anchors"],
                       "mean_acceptance_length": round(ev["mean_acceptance_length"], 3),
                       "accept_rate_per_pos": [round(x, 3) for x in ev["accept_rate_per_pos"]]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="smollm2-135m-dflash", help="catalog name or drafter directory")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts-per-suite", type=int, default=2)
    ap.add_argument("--answers", default=None, help="answers.pt saved by train-drafter (for the held-out set)")
    ap.add_argument("--per-source", type=int, default=40, help="held-out sequences per source")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    where = drafter_location(a.drafter)
    cfg = json.loads((Path(where) / "config.json").read_text())
    target = load_model(cfg["target"]["name"])
    model = load_dflash_model(Path(where), target)  # the weights as trained
    bench = bench_answers(target, a.tokens, a.prompts_per_suite)
    report = {"drafter": a.drafter, "bench": acceptance(model, target, bench),
              "bench_decoding": decode_check(where, target, bench)}
    if a.answers:
        report["held-out"] = acceptance(model, target, held_out(Path(a.answers), a.per_source))
    for source, r in report["bench_decoding"].items():
        print(f"decoding  {source:9s} mean acceptance length {r['mean_acceptance_length']:.2f}  proposals equal "
              f"to teacher-forced {r['equal_to_teacher_forced']}/{r['steps']}")
    for group, rows in report.items():
        if group in ("bench", "held-out"):
            for source, r in rows.items():
                print(f"{group:9s} {source:9s} mean acceptance length {r['mean_acceptance_length']:.2f}  "
                      f"first drafts accepted {r['accept_rate_per_pos'][0]:.0%}  ({r['sequences']} sequences)")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
