"""Check the CUDA path on a machine with a GPU, and record a speed figure.

CI has no GPU, so this script is what exercises the torch/CUDA code path (model forward with
torch attention, the engine, speculation, `train-drafter --device cuda`):

1. forward: a tiny random Llama's hidden states on CUDA (float32, TF32 off) match the CPU
   kernels' (every sequence of a mixed prefill batch);
2. lossless: greedy output with speculation (the tiny model as its own draft) equals plain
   greedy on CUDA;
3. train: `specserve train-drafter --device cuda` on the tiny model (loss falls), and the dflash
   drafter it writes is lossless on CUDA;
4. speed (``--model NAME``): plain vs ngram/dflash greedy decode tok/s of a real model on CUDA.

    python benchmarks/cuda_check.py --out report.json [--model smollm2-135m [--dflash DIR]]

Exit status 1 if a check fails; the JSON report is written either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from specserve.engine.config import EngineConfig  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.registry import build_drafter  # noqa: E402
from specserve.speculative.train import data as tdata  # noqa: E402

DEVICE = {"name": "cuda"}  # --device cpu: a dry run of this script's logic on a machine without a GPU


def dev32() -> LoadOptions:
    return LoadOptions(device=DEVICE["name"], dtype="float32", quantization="none")


def greedy(target, prompts, max_tokens, spec=None, drafter=None):
    eng = LLMEngine(target, EngineConfig(max_num_seqs=4, max_model_len=512), spec, drafter)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts):
        eng.add_request(rid, ids, params)
    got = {rid: [] for rid in rids}
    t0 = time.perf_counter()
    while eng.has_work():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    dt = time.perf_counter() - t0
    return [got[r] for r in rids], dt, eng


def check_forward(tiny_dir: Path) -> dict:
    cpu = load_model(str(tiny_dir), LoadOptions(device="cpu", quantization="none"))
    gpu = load_model(str(tiny_dir), dev32())
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (37, 5, 120, 64)]
    a = tdata.capture_hidden(cpu, seqs, (0, 2))
    b = tdata.capture_hidden(gpu, seqs, (0, 2))
    err = max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(a, b))
    return {"ok": err < 1e-4, "max_rel_err_vs_cpu": err}


def check_lossless(target, prompts, drafter_spec: SpeculativeConfig, drafter=None, max_tokens=48) -> dict:
    if drafter is None:
        drafter = build_drafter(drafter_spec, target, dev32(), EngineConfig(), 512)
    plain, t_plain, _ = greedy(target, prompts, max_tokens)
    spec, t_spec, eng = greedy(target, prompts, max_tokens, drafter_spec, drafter)
    tot = eng.totals
    return {"ok": plain == spec and tot.accepted_tokens > 0, "tokens": sum(map(len, plain)), "accepted": tot.accepted_tokens,
            "drafted": tot.draft_tokens, "plain_s": round(t_plain, 3), "spec_s": round(t_spec, 3)}


def check_train(tiny_dir: Path, work: Path) -> dict:
    from specserve.cli import main

    out = work / "drafter"
    argv = ["train-drafter", "--model", str(tiny_dir), "--method", "dflash", "--out", str(out),
            "--device", DEVICE["name"], "--dtype", "float32", "--quantization", "none", "--data", "math:16",
            "--steps", "30", "--batch", "4", "--seq-len", "128", "--max-new-tokens", "32", "--block-size", "4",
            "--eval-every", "10", "--save-every", "10", "--warmup", "3", "--lr", "2e-3"]
    rc = main(argv)
    log = json.loads((out / "train_log.json").read_text())
    losses = [e["loss"] for e in log if "loss" in e]
    target = load_model(str(tiny_dir), dev32())
    spec = SpeculativeConfig("dflash", num_speculative_tokens=3, model=str(out), adaptive=False)
    drafter = build_drafter(spec, target, None, EngineConfig(), 512)
    examples, _ = tdata.load_dataset(out / "data" / "dataset.pt")
    prompts = [e.ids[:e.prompt_len].tolist() for e in examples[:3]]
    lossless = check_lossless(target, prompts, spec, drafter, 32)
    return {"ok": rc == 0 and losses[-1] < losses[0] and lossless["ok"], "first_loss": losses[0],
            "last_loss": losses[-1], "lossless": lossless}


def speed(name: str, dflash: str | None) -> dict:
    target = load_model(name, LoadOptions(device=DEVICE["name"]))
    prompts = [tdata.chat_prompt_ids(target, p) for p in (
        "Write a Python function that merges two sorted lists, with a docstring and tests.",
        "A shop sells pens at $3 each and notebooks at $5 each. Sam buys 4 pens and 3 notebooks and pays "
        "with a $50 bill. How much change does he get? Explain step by step.")]
    out = {"model": name, "dtype": str(target.model.dtype)}
    greedy(target, prompts[:1], 16)  # warm-up
    plain, t_plain, _ = greedy(target, prompts, 192)
    out["plain_tok_s"] = round(sum(map(len, plain)) / t_plain, 1)
    specs = {"ngram": SpeculativeConfig("ngram", num_speculative_tokens=5)}
    if dflash:
        specs["dflash"] = SpeculativeConfig("dflash", num_speculative_tokens=7, model=dflash)
    for label, spec in specs.items():
        drafter = build_drafter(spec, target, None, EngineConfig(), 1024)
        got, t, eng = greedy(target, prompts, 192, spec, drafter)
        out[label] = {"tok_s": round(sum(map(len, got)) / t, 1), "identical_to_plain": got == plain,
                      "mean_acceptance_length": round(eng.totals.mean_acceptance_length, 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="cuda_check.json")
    ap.add_argument("--model", default=None, help="also measure decode speed of this model on CUDA")
    ap.add_argument("--dflash", default=None, help="a dflash drafter directory for --model")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: dry run of the script")
    args = ap.parse_args()
    DEVICE["name"] = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    from test_dflash import make_tiny_target

    report: dict = {"torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny_dir = work / "tiny"
        make_tiny_target(tiny_dir, seed=7)
        g = torch.Generator().manual_seed(1)
        loop = torch.randint(0, 256, (12,), generator=g).tolist()
        prompts = [loop * 4, torch.randint(0, 256, (30,), generator=g).tolist()]
        checks = {
            "forward": lambda: check_forward(tiny_dir),
            # the target as its own draft model: every draft is accepted, 5-row verification on CUDA
            "lossless_draft_model": lambda: check_lossless(
                load_model(str(tiny_dir), dev32()), prompts,
                SpeculativeConfig("draft_model", num_speculative_tokens=4, model=str(tiny_dir), adaptive=False)),
            "train_dflash": lambda: check_train(tiny_dir, work),
        }
        if args.model:
            checks["speed"] = lambda: speed(args.model, args.dflash)
        for name, fn in checks.items():
            t0 = time.perf_counter()
            try:
                report[name] = fn()
            except Exception as exc:  # noqa: BLE001 - a report, not a crash, is the point
                report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                "trace": traceback.format_exc()[-2000:]}
            report[name]["seconds"] = round(time.perf_counter() - t0, 1)
            print(name, json.dumps(report[name])[:600], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(v.get("ok", True) for v in report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
