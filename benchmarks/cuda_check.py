"""Check the CUDA path on a machine with a GPU, and record a speed figure.

CI has no GPU, so this script is what exercises the torch/CUDA code path (model forward with
torch attention, the engine, speculation, `train-drafter --device cuda`):

1. forward: a tiny random Llama's hidden states on CUDA (float32, TF32 off) match the CPU
   kernels' (every sequence of a mixed prefill batch);
2. lossless: greedy output with speculation (the tiny model as its own draft) equals plain
   greedy on CUDA;
3. train: `specserve train-drafter --device cuda` on the tiny model (loss falls), and the dflash
   drafter it writes is lossless on CUDA;
4. batch invariance: each CUDA op's rows alone against the same rows in a larger call (bf16),
   and the tiny model in bf16 lossless with every drafter, with the linears' row tiles and
   without;
5. tensor parallel: the tiny model over 2 ranks on CUDA (NCCL between ranks with a GPU each,
   else gloo through host memory: ranks sharing one GPU) against one rank: logits, greedy tokens
   run to run, and every drafter lossless alone and in a batch of 8; the NCCL group's collectives;
6. speed (``--model NAME``): plain vs ngram/dflash greedy decode tok/s of a real model on CUDA;
7. real shapes (``--shape-dir DIR``, benchmarks/cuda_shapes.py): a catalog model's config and
   tokenizer with random weights written here (the catalog's files do not reach a GPU machine):
   plain vs ngram on one rank and on two, and where their rows part if they do.

    python benchmarks/cuda_check.py --out report.json [--model smollm2-135m [--dflash DIR]]
        [--shape-dir DIR [--shape-layers N]] [--only check,...]
    python benchmarks/cuda_check.py --make-shape-dir qwen2.5-coder-1.5b DIR   # (here, for --shape-dir there)

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
    eng = LLMEngine(target, EngineConfig(max_num_seqs=max(4, len(prompts)), max_model_len=512,
                                         kv_cache_memory=256 << 20), spec, drafter)
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
    return {"ok": plain == spec and tot.accepted_tokens > 0, "tokens": sum(map(len, plain)),
            "accepted": tot.accepted_tokens, "drafted": tot.draft_tokens, "plain_s": round(t_plain, 3),
            "spec_s": round(t_spec, 3)}


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


def decode_speed(target, prompts: list[list[int]], tokens: int, specs: dict) -> dict:
    """Greedy decode tok/s of prompts together, plain and with each speculative config, and
    whether each gives plain's tokens."""
    greedy(target, prompts[:1], 8)  # warm-up
    plain, t_plain, _ = greedy(target, prompts, tokens)
    out = {"dtype": str(target.model.dtype), "plain_tok_s": round(sum(map(len, plain)) / t_plain, 1)}
    for label, spec in specs.items():
        got, t, eng = greedy(target, prompts, tokens, spec, build_drafter(spec, target, None, EngineConfig(), 512))
        out[label] = {"tok_s": round(sum(map(len, got)) / t, 1), "identical_to_plain": got == plain,
                      "mean_acceptance_length": round(eng.totals.mean_acceptance_length, 3)}
    return out


def speed(name: str, dflash: str | None) -> dict:
    target = load_model(name, LoadOptions(device=DEVICE["name"]))
    prompts = [tdata.chat_prompt_ids(target, p) for p in (
        "Write a Python function that merges two sorted lists, with a docstring and tests.",
        "A shop sells pens at $3 each and notebooks at $5 each. Sam buys 4 pens and 3 notebooks and pays "
        "with a $50 bill. How much change does he get? Explain step by step.")]
    specs = {"ngram": SpeculativeConfig("ngram", num_speculative_tokens=5)}
    if dflash:
        specs["dflash"] = SpeculativeConfig("dflash", num_speculative_tokens=7, model=dflash)
    return {"model": name, **decode_speed(target, prompts, 192, specs)}


def tp_target(model_dir: Path, dtype: str, layers: int | None = None):
    """model_dir split over 2 ranks on DEVICE (this process rank 0, a worker process rank 1)."""
    from specserve.commands.args import add_engine_args
    from specserve.engine.builder import build_parts

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(["--model", str(model_dir), "--device", DEVICE["name"], "--dtype", dtype,
                          "--quantization", "none", "--max-model-len", "512", "-tp", "2", "--threads", "1"])
    return build_parts(args).target


def drafters_lossless(target, ps: list[list[int]], plain, draft_dir: Path, options: LoadOptions) -> dict:
    """Greedy output with each drafter (a batch of 8, and two prompts alone) against plain."""
    specs = {"ngram": SpeculativeConfig("ngram", num_speculative_tokens=4),
             "suffix": SpeculativeConfig("suffix", num_speculative_tokens=4),
             "draft_model": SpeculativeConfig("draft_model", num_speculative_tokens=4, model=str(draft_dir),
                                              adaptive=False)}
    out = {}
    for label, spec in specs.items():
        drafter = build_drafter(spec, target, options, EngineConfig(), 512)
        batch, _, eng = greedy(target, ps, 32, spec, drafter)
        alone = [greedy(target, [p], 32, spec, drafter)[0][0] for p in ps[:2]]
        out[label] = {"ok": batch == plain and alone == plain[:2], "batch_of_8_identical": batch == plain,
                      "alone_identical": alone == plain[:2], "accepted": eng.totals.accepted_tokens}
    return out


def check_lossless_bf16(tiny_dir: Path) -> dict:
    """The tiny model in bf16 on one device, every drafter against plain; again with the
    linears in one cuBLAS call over every row (no fixed row tiles) to show what the tiles buy."""
    from specserve.models import layers
    from test_tensor_parallel import prompts as tp_prompts

    opts = LoadOptions(device=DEVICE["name"], dtype="bfloat16" if DEVICE["name"] == "cuda" else "float32",
                       quantization="none")
    target, ps, out = load_model(str(tiny_dir), opts), tp_prompts(), {}
    for label, tile in (("row_tiles", layers.CUDA_ROW_TILE), ("one_call", 0)):
        saved, layers.CUDA_ROW_TILE = layers.CUDA_ROW_TILE, tile
        try:
            plain, _, _ = greedy(target, ps, 32)
            out[label] = drafters_lossless(target, ps, plain, tiny_dir, opts)
        finally:
            layers.CUDA_ROW_TILE = saved
    return {"ok": all(v["ok"] for v in out["row_tiles"].values()), **out}


def check_tensor_parallel(tiny_dir: Path) -> dict:
    from specserve.parallel.launch import stop_workers
    from test_tensor_parallel import prompts as tp_prompts, run_logits

    one = load_model(str(tiny_dir), dev32())
    two = tp_target(tiny_dir, "float32")
    try:
        ps = tp_prompts()
        a, b = run_logits(one, ps[0]), run_logits(two, ps[0])
        err = float((a - b).abs().max() / a.abs().max())
        plain, _, _ = greedy(two, ps, 32)
        again, _, _ = greedy(two, ps, 32)
        single, _, _ = greedy(one, ps, 32)
        out = {"backend": two.model.tp.backend, "logits_max_rel_err_vs_one_rank": err,
               "deterministic": plain == again,
               "first_16_tokens_as_one_rank": f"{sum(x[:16] == y[:16] for x, y in zip(plain, single))}/8",
               **drafters_lossless(two, ps, plain, tiny_dir, dev32())}
        ok = err < 1e-3 and out["deterministic"] and all(v["ok"] for v in out.values() if isinstance(v, dict))
        return {"ok": ok, **out}
    finally:
        stop_workers(two.model.tp)


def check_invariance_probe() -> dict:
    """Each CUDA op's rows alone against the same rows inside larger steps (bitwise), at
    qwen2.5-coder-1.5b's shapes in bf16: mismatching row sets per op."""
    from specserve.models import device_attention, layers

    dev = torch.device(DEVICE["name"])
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(8960, 1536, device=dev, generator=g) * 0.03).to(dt)
    x = torch.randn(200, 1536, device=dev, generator=g).to(dt)
    sets = [slice(0, 1), slice(0, 2), slice(3, 11), slice(0, 8), slice(0, 64), slice(100, 101), slice(60, 130)]

    def mismatches(fn):
        full = fn(x)
        return [f"{r.start}:{r.stop}" for r in sets if not torch.equal(fn(x[r]), full[r])]

    out = {"linear_one_call": mismatches(lambda v: layers.device_linear(v, w, None, tile=0)),
           "linear_row_tiles": mismatches(lambda v: layers.device_linear(v, w, None)),
           "rms_norm": mismatches(lambda v: layers.rms_norm(v, torch.ones(1536, device=dev), 1e-6))}
    kc = torch.randn(128, 16, 2, 128, device=dev, generator=g).to(dt)
    vc = torch.randn(128, 16, 2, 128, device=dev, generator=g).to(dt)
    tables = torch.stack([torch.arange(64), torch.arange(64, 128)]).to(dev, torch.int32)
    q = torch.randn(24, 12, 128, device=dev, generator=g).to(dt)
    sid = torch.tensor([0] * 8 + [1] * 16, device=dev, dtype=torch.int32)
    pos = torch.cat([torch.arange(300, 308), torch.arange(900, 916)]).to(dev, torch.int32)

    def attn(idx):
        return device_attention.paged_attention(q[idx], kc, vc, tables, sid[idx], pos[idx], 128 ** -0.5, 0, 0.0)

    full = attn(torch.arange(24, device=dev))
    bad = [i for i in range(24) if not torch.equal(attn(torch.tensor([i], device=dev))[0], full[i])]
    out["attention_rows_differing_alone"] = bad
    out["ok"] = not (out["linear_row_tiles"] or out["rms_norm"] or bad)
    return out


def check_nccl_group() -> dict:
    """The NCCL group's collectives (one rank: one GPU cannot hold two NCCL ranks)."""
    import torch.distributed as dist

    from specserve.bench.serverproc import free_port
    from specserve.parallel.group import TensorParallel

    if DEVICE["name"] != "cuda" or not dist.is_nccl_available():
        return {"ok": True, "skipped": "no CUDA device or torch without NCCL"}
    dev = torch.device("cuda", 0)
    tp = TensorParallel.connect(0, 1, "127.0.0.1", free_port(), 30.0, device=dev)
    x = torch.randn(4, 64, device=dev, dtype=torch.bfloat16)
    summed, gathered = tp.all_reduce(x.clone()), tp.all_gather_cat(x)
    return {"ok": tp.backend == "nccl" and torch.equal(summed, x) and torch.equal(gathered, x),
            "backend": tp.backend, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="cuda_check.json")
    ap.add_argument("--model", default=None, help="also measure decode speed of this model on CUDA")
    ap.add_argument("--dflash", default=None, help="a dflash drafter directory for --model")
    ap.add_argument("--shape-dir", default=None, help="config.json + tokenizer: speed of random weights at its shapes")
    ap.add_argument("--shape-layers", type=int, default=None, help="fewer layers than the config's (a dry run)")
    ap.add_argument("--make-shape-dir", nargs=2, metavar=("MODEL", "DIR"), default=None,
                    help="write a catalog model's config and tokenizer to DIR (for --shape-dir) and exit")
    ap.add_argument("--only", default=None, help="comma-separated checks to run (default: all)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: dry run of the script")
    args = ap.parse_args()
    DEVICE["name"] = args.device
    sys.modules.setdefault("cuda_check", sys.modules[__name__])  # cuda_shapes shares this run's DEVICE
    import cuda_shapes as shapes

    if args.make_shape_dir:
        print(shapes.make_shape_dir(args.make_shape_dir[0], Path(args.make_shape_dir[1])))
        return 0
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
            "invariance_probe": check_invariance_probe,
            "lossless_bf16": lambda: check_lossless_bf16(tiny_dir),
            "tensor_parallel": lambda: check_tensor_parallel(tiny_dir),
            "nccl_group": check_nccl_group,
        }
        if args.model:
            checks["speed"] = lambda: speed(args.model, args.dflash)
        if args.shape_dir:
            checks["shape_rows"] = lambda: shapes.check_shape_rows(Path(args.shape_dir), work, args.shape_layers)
            checks["shape_divergence"] = lambda: shapes.check_shape_divergence(Path(args.shape_dir), work,
                                                                               args.shape_layers)
            checks["shape_history"] = lambda: shapes.check_shape_history(Path(args.shape_dir), work,
                                                                         args.shape_layers)
            checks["shape_speed"] = lambda: shapes.shape_speed(Path(args.shape_dir), work, args.shape_layers)
        if args.only:
            checks = {k: v for k, v in checks.items() if k in args.only.split(",")}
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
