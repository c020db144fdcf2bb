"""``specserve train-drafter``: train a dflash block drafter or an MTP head for a target model.

The target answers prompts itself (self-distillation, see specserve.spec.train.data); the
drafter learns those answers from the target's hidden states with the target frozen. The
result (OUT/config.json + OUT/model.safetensors) is used with
``--speculative-config '{"method": "dflash", "model": "OUT"}'`` (or ``"mtp"``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specserve.models.quant import QUANTIZATIONS


def add_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="train a dflash or mtp drafter for a model (self-distillation)")
    p.add_argument("--model", default="smollm2-135m", help="the target model (catalog name, file or directory)")
    p.add_argument("--method", required=True, choices=["dflash", "mtp"])
    p.add_argument("--out", required=True, help="output directory (checkpoint, data cache, final drafter)")
    p.add_argument("--data", default="sharegpt:200,stdlib:200,math:100,debian:100",
                   help="prompt sources and counts, e.g. sharegpt:200,stdlib:200,math:100,debian:100")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--stop-at", type=int, default=None, help="stop (and checkpoint) after this step")
    p.add_argument("--time-limit", type=float, default=None, help="stop (and checkpoint) after this many minutes")
    p.add_argument("--block-size", type=int, default=8, help="dflash block size B (B-1 drafts per forward)")
    p.add_argument("--layers", type=int, default=1, help="dflash drafter layers (1-5)")
    p.add_argument("--target-layers", type=int, default=3, help="dflash: target layers to read")
    p.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: the target's)")
    p.add_argument("--depth", type=int, default=3, help="mtp: chained steps trained")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512, help="training window (tokens)")
    p.add_argument("--anchors", type=int, default=8, help="dflash: blocks per sequence per step")
    p.add_argument("--decay", type=float, default=0.8, help="loss weight decay per block position / depth")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length when generating data")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the target's answers")
    p.add_argument("--gen-batch", type=int, default=16, help="sequences the engine decodes together for the data")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the exported drafter weights (checkpoints are always float32)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="the target's weight format while generating data")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from specserve.engine.builder import set_threads
    from specserve.models.loader import LoadOptions, load_model
    from specserve.spec.train import data as tdata
    from specserve.spec.train.trainer import (FrozenTarget, HParams, Trainer, make_model, model_from_checkpoint,
                                              split)

    def say(msg: str) -> None:
        print(f"[train-drafter {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    set_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.model, LoadOptions(args.device, "auto", args.quantization))
    device = target.model.device
    say(f"target {target.name}: {target.config.num_layers} layers, hidden {target.config.hidden_size}, on {device}")

    if args.resume:
        model = model_from_checkpoint(args.method, out)
    else:
        model = make_model(args.method, target, layers=args.layers, block_size=args.block_size,
                           num_target_layers=args.target_layers, intermediate_size=args.intermediate_size,
                           depth=args.depth, seed=args.seed)
    if args.method == "dflash":
        layers, final_norm = tuple(model.cfg.target_layer_ids), False
    else:
        layers, final_norm = (target.config.num_layers - 1,), True

    data_path = out / "data" / "dataset.pt"
    meta = {"model": target.name, "method": args.method, "layers": list(layers), "final_norm": final_norm,
            "data": args.data, "max_new_tokens": args.max_new_tokens, "seq_len": args.seq_len,
            "temperature": args.temperature, "seed": args.seed}
    examples = None
    if data_path.is_file():
        cached, cmeta = tdata.load_dataset(data_path)
        if cmeta == meta:
            examples = cached
            say(f"using the cached dataset {data_path} ({len(examples)} sequences)")
    if examples is None:
        prompts = tdata.load_prompts(args.data, args.seed)
        say(f"{len(prompts)} prompts; generating the target's answers")
        t0 = time.perf_counter()
        examples = tdata.build_dataset(target, prompts, layers=layers, final_norm=final_norm,
                                       max_new_tokens=args.max_new_tokens, max_len=args.seq_len,
                                       temperature=args.temperature, seed=args.seed, max_num_seqs=args.gen_batch,
                                       progress=say)
        tdata.save_dataset(examples, data_path, meta)
        n_tok = sum(len(e.ids) - e.prompt_len for e in examples)
        say(f"dataset: {len(examples)} sequences, {n_tok} answer tokens, {time.perf_counter() - t0:.0f} s")
    train, val = split(examples, args.val_fraction, args.seed)

    hp = HParams(steps=args.steps, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, batch=args.batch,
                 seq_len=args.seq_len, anchors=args.anchors, decay=args.decay, seed=args.seed,
                 eval_every=args.eval_every, save_every=args.save_every)
    trainer = Trainer(args.method, model, FrozenTarget.from_target(target, device), train, val, hp, out, device)
    if args.resume:
        trainer.load_checkpoint()
        say(f"resumed at step {trainer.state.step}")
    elif trainer.val_set:
        ev = trainer.evaluate()
        trainer.state.log.append({"step": 0, **ev})
        say(f"step 0 validation mean acceptance length {ev['mean_acceptance_length']:.3f}")
    trainer.run(stop_at=args.stop_at, time_limit=None if args.time_limit is None else args.time_limit * 60,
                progress=say)
    if trainer.val_set:
        ev = trainer.evaluate()
        trainer.state.log.append({"step": trainer.state.step, "final": True, **ev})
        say(f"final validation mean acceptance length {ev['mean_acceptance_length']:.3f} "
            f"(per position {', '.join(f'{x:.2f}' for x in ev['accept_rate_per_pos'])})")
    trainer.export(getattr(torch, args.export_dtype))
    say(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}; use --speculative-config "
        + json.dumps(json.dumps({"method": args.method, "model": str(out)})))
    return 0
