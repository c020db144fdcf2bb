"""``specserve train-drafter``: train a dflash block drafter or an MTP head for a target model.

The target answers prompts itself (self-distillation, see specserve.speculative.train.data); the
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

from specserve.commands.args import MAX_THREADS, int_in, nonnegative_float, positive_float
from specserve.errors import SpecserveError
from specserve.models.quant import QUANTIZATIONS


DEFAULT_DATA = "sharegpt:200,stdlib:200,math:100,debian:100"


def add_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="train a dflash or mtp drafter for a model (self-distillation)")
    p.add_argument("--model", default="smollm2-135m", help="the target model (catalog name, file or directory)")
    p.add_argument("--method", required=True, choices=["dflash", "mtp"])
    p.add_argument("--out", required=True, help="output directory (checkpoint, data cache, final drafter)")
    p.add_argument("--data", default=None,
                   help=f"prompt sources and counts (default {DEFAULT_DATA}, or none with --prompts)")
    p.add_argument("--prompts", action="append", default=[], metavar="FILE",
                   help="your own prompts: JSONL or a JSON array of {\"prompt\": ...}, {\"messages\": [...]} or "
                        "ShareGPT {\"conversations\": [...]} records (repeatable; every prompt is used)")
    p.add_argument("--steps", type=int_in(1), default=1000)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--stop-at", type=int_in(1), default=None, help="stop (and checkpoint) after this step")
    p.add_argument("--time-limit", type=positive_float, default=None,
                   help="stop (and checkpoint) after this many minutes")
    p.add_argument("--time-budget", type=positive_float, default=None,
                   help="train for this many minutes, the learning-rate schedule following the time spent "
                        "(ends on time on any device; not bit-reproducible on --resume)")
    p.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="fine-tune a trained drafter (a train-drafter output directory or a catalog drafter "
                        "such as smollm2-135m-dflash) instead of starting a fresh one; its shape is kept")
    p.add_argument("--block-size", type=int_in(2, 64), default=None,
                   help="dflash block size B (B-1 drafts per forward; default 8)")
    p.add_argument("--layers", type=int_in(1, 5), default=None, help="dflash drafter layers (1-5; default 1)")
    p.add_argument("--target-layers", type=int_in(1), default=None, help="dflash: target layers to read (default 3)")
    p.add_argument("--intermediate-size", type=int_in(1), default=None,
                   help="drafter MLP width (default: the target's)")
    p.add_argument("--init-from-target", action="store_true",
                   help="dflash: start the drafter's layers as copies of the target's last layers "
                        "(needs --intermediate-size equal to the target's)")
    p.add_argument("--draft-vocab-size", type=int_in(1), default=None,
                   help="dflash: the drafter's default draft vocabulary (the target's LM head cut to this many "
                        "tokens, ranked by the training answers' token counts); the speculative config's "
                        "draft_vocab_size overrides it")
    p.add_argument("--depth", type=int_in(1, 16), default=None, help="mtp: chained steps trained (default 3)")
    p.add_argument("--lr", type=positive_float, default=6e-4)
    p.add_argument("--warmup", type=int_in(0), default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--batch", type=int_in(1), default=8)
    p.add_argument("--seq-len", type=int_in(16), default=512, help="training window (tokens)")
    p.add_argument("--anchors", type=int_in(1), default=8, help="dflash: blocks per sequence per step")
    p.add_argument("--decay", type=positive_float, default=0.8, help="loss weight decay per block position / depth")
    p.add_argument("--max-new-tokens", type=int_in(1), default=256, help="answer length when generating data")
    p.add_argument("--temperature", type=nonnegative_float, default=0.0,
                   help="sampling temperature of the target's answers")
    p.add_argument("--gen-batch", type=int_in(1), default=16, help="sequences the engine decodes together for the data")
    p.add_argument("--answers-only", action="store_true",
                   help="only generate the target's answers (OUT/data/answers.pt, saved as they come, resumable) "
                        "and stop; a later run with the same data options trains on them, e.g. on a GPU")
    p.add_argument("--use-saved-answers", action="store_true",
                   help="train on the answers already in OUT/data/answers.pt (made with the same data options), "
                        "without reading the prompt sources or generating more (e.g. on a machine with no network)")
    p.add_argument("--more-answers", action="append", default=[], metavar="FILE",
                   help="with --use-saved-answers: also train on the answers.pt of another run for the same "
                        "model and --seq-len (other --data or --seed; repeatable; a sequence already present "
                        "is taken once)")
    p.add_argument("--max-answers", type=int_in(1), default=None,
                   help="with --use-saved-answers: train on a random N of them (the same N for a --seed), e.g. "
                        "to fit a CPU's time")
    p.add_argument("--no-data-cache", action="store_true",
                   help="do not save the hidden-state dataset (OUT/data/dataset.pt; several GB for large --data)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--eval-every", type=int_in(0), default=100, help="steps between validations (0: only at the end)")
    p.add_argument("--save-every", type=int_in(0), default=100, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-dtype", default="float32", choices=["float32", "bfloat16", "float16", "int8"],
                   help="dtype of the exported drafter weights (int8: matrices per-row symmetric int8, the "
                        "format the CPU runs them in; checkpoints are always float32)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's activation dtype (CUDA defaults to bfloat16; float32 gives hidden states "
                        "closer to the CPU engine's)")
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="the target's weight format while generating data")
    p.add_argument("--threads", type=int_in(0, MAX_THREADS), default=None,
                   help="CPU threads (default or 0: the cores this process may use)")
    p.set_defaults(func=run)


SHAPE_OPTIONS = ("block_size", "layers", "target_layers", "intermediate_size", "depth", "init_from_target")


def check_args(args: argparse.Namespace) -> None:
    """Option clashes, before the target loads."""
    if args.max_answers is not None and not args.use_saved_answers:
        raise SpecserveError("--max-answers N goes with --use-saved-answers")
    if args.more_answers and not args.use_saved_answers:
        raise SpecserveError("--more-answers FILE goes with --use-saved-answers")
    missing = [f for f in args.more_answers if not Path(f).expanduser().is_file()]
    if missing:
        raise SpecserveError(f"--more-answers {missing[0]}: no such file")
    from specserve.speculative.train.data import parse_data_spec

    if args.data is None:
        args.data = "" if args.prompts else DEFAULT_DATA
    parse_data_spec(args.data, allow_empty=bool(args.prompts))
    unreadable = [f for f in args.prompts if not Path(f).expanduser().is_file()]
    if unreadable:
        raise SpecserveError(f"--prompts {unreadable[0]}: no such file")
    if not 0 <= args.val_fraction < 1:
        raise SpecserveError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.init_from is not None:
        if args.resume:
            raise SpecserveError("--init-from starts a new run; --resume continues OUT/checkpoint (pick one)")
        given = [o for o in SHAPE_OPTIONS if getattr(args, o) not in (None, False)]
        if given:
            raise SpecserveError(f"--init-from keeps the drafter's shape; drop --{given[0].replace('_', '-')}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise SpecserveError(f"--out {out} exists and is not a directory")
    if args.resume and not (out / "checkpoint" / "config.json").is_file():
        raise SpecserveError(f"--resume: no checkpoint in {out / 'checkpoint'} (a run writes one every "
                             "--save-every steps)")


def run(args: argparse.Namespace) -> int:
    """The command; TF32 (turned on for CUDA training) is this run's setting, not the process's:
    a caller that goes on to compare float32 results gets its own setting back."""
    import torch

    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        return _run(args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _run(args: argparse.Namespace) -> int:
    check_args(args)
    import torch

    from specserve.engine.builder import set_threads
    from specserve.speculative.train.trainer import split

    def say(msg: str) -> None:
        print(f"[train-drafter {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    set_threads(args.threads)
    torch.manual_seed(args.seed)
    target, out = _target_and_out(args, say)
    model = _initial_model(args, target, out, say)
    if args.method == "dflash":
        layers, final_norm = tuple(model.cfg.target_layer_ids), False
    else:
        layers, final_norm = (target.config.num_layers - 1,), True
    answers_meta = _answers_meta(args, target)
    if args.answers_only:
        answers = _answers(args, target, out, answers_meta, say)
        n_tok = sum(len(a.ids) - a.prompt_len for a in answers)
        say(f"{len(answers)} answers, {n_tok} answer tokens in {out / 'data' / 'answers.pt'}")
        return 0
    examples = _examples(args, target, out, answers_meta, layers, final_norm, say)
    trainer = _train(args, model, target, split(examples, args.val_fraction, args.seed), out, say)
    _export(args, model, target, examples, trainer, out, say)
    return 0


def _target_and_out(args: argparse.Namespace, say):
    """The target model (loaded first: a bad --model leaves no directory) and the --out directory."""
    import torch

    from specserve.models.loader import LoadOptions, load_model

    target = load_model(args.model, LoadOptions(args.device, args.dtype, args.quantization))
    if args.target_layers is not None and args.target_layers > target.config.num_layers:
        raise SpecserveError(f"--target-layers {args.target_layers}: {target.name} has "
                             f"{target.config.num_layers} layers")
    out = Path(args.out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecserveError(f"cannot create --out {out}: {exc.strerror or exc}") from exc
    device = target.model.device
    if device.type == "cuda":  # the frozen target's hidden states and the drafter's float32 matmuls in TF32
        torch.backends.cuda.matmul.allow_tf32 = True
    say(f"target {target.name}: {target.config.num_layers} layers, hidden {target.config.hidden_size}, on {device}")
    return target, out


def _initial_model(args: argparse.Namespace, target, out: Path, say):
    """The drafter to train: --resume's checkpoint, --init-from's drafter, or a new one of the asked shape."""
    from specserve.speculative.train.trainer import make_model, model_from_checkpoint, model_from_drafter

    if args.resume:
        return model_from_checkpoint(args.method, out)
    if args.init_from is not None:
        say(f"fine-tuning {args.init_from}")
        return model_from_drafter(args.method, args.init_from, target)
    shape = {"layers": args.layers, "block_size": args.block_size, "num_target_layers": args.target_layers,
             "intermediate_size": args.intermediate_size, "depth": args.depth}
    return make_model(args.method, target, seed=args.seed, init_from_target=args.init_from_target,
                      **{k: v for k, v in shape.items() if v is not None})  # else make_model's defaults


def _answers_meta(args: argparse.Namespace, target) -> dict:
    """What the saved answers depend on: a saved set is reused only when all of it matches."""
    from specserve.speculative.layers import target_identity
    from specserve.speculative.train import data as tdata

    meta = {"model": target.name, "vocab": target_identity(target)["vocab_hash"], "data": args.data,
            "max_new_tokens": args.max_new_tokens, "seq_len": args.seq_len,
            "temperature": args.temperature, "seed": args.seed}
    if args.prompts:  # the answers depend on the files' contents
        meta["prompts"] = tdata.prompt_files_meta(args.prompts)
    return meta


def _train(args: argparse.Namespace, model, target, train_val, out: Path, say):
    """Train (or resume) to --steps, with a validation before (a new run) and after."""
    from specserve.speculative.train.trainer import FrozenTarget, HParams, Trainer

    device = target.model.device
    hp = HParams(steps=args.steps, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, batch=args.batch,
                 seq_len=args.seq_len, anchors=args.anchors, decay=args.decay, seed=args.seed,
                 eval_every=args.eval_every, save_every=args.save_every)
    trainer = Trainer(args.method, model, FrozenTarget.from_target(target, device), *train_val, hp, out, device)
    if args.resume:
        trainer.load_checkpoint()
        say(f"resumed at step {trainer.state.step}")
    elif trainer.val_set:
        ev = trainer.evaluate()
        trainer.state.log.append({"step": 0, **ev})
        say(f"step 0 validation mean acceptance length {ev['mean_acceptance_length']:.3f}")
    trainer.run(stop_at=args.stop_at, time_limit=None if args.time_limit is None else args.time_limit * 60,
                progress=say, time_budget=None if args.time_budget is None else args.time_budget * 60)
    if trainer.val_set:
        ev = trainer.evaluate()
        trainer.state.log.append({"step": trainer.state.step, "final": True, **ev})
        say(f"final validation mean acceptance length {ev['mean_acceptance_length']:.3f} "
            f"(per position {', '.join(f'{x:.2f}' for x in ev['accept_rate_per_pos'])})")
    return trainer


def _export(args: argparse.Namespace, model, target, examples, trainer, out: Path, say) -> None:
    """The drafter's files in --out: weights, config and (dflash, mtp) the token counts of all it was trained on."""
    import torch

    from specserve.models.catalog import drafter_location
    from specserve.speculative.drafter_files import load_token_counts, save_token_counts

    if args.method == "dflash" and args.draft_vocab_size is not None:  # else a fine-tuned drafter's default stays
        model.cfg.draft_vocab_size = args.draft_vocab_size
    if args.method in ("dflash", "mtp"):  # the counts that rank a draft vocabulary (draft_vocab_size)
        V = target.config.vocab_size
        answer_ids = torch.cat([e.ids[e.prompt_len:] for e in examples]).clamp(max=V - 1)
        counts = torch.bincount(answer_ids, minlength=V)  # one op: cheap on any machine
        start = (model.cfg.training.get("init_from") or {}).get("drafter")  # also after --resume
        before = None if start is None else load_token_counts(Path(drafter_location(start)))
        save_token_counts(counts if before is None else counts + before[:V], out)
    trainer.export(getattr(torch, args.export_dtype))
    say(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}; use --speculative-config "
        + json.dumps(json.dumps({"method": args.method, "model": str(out)})))


def _answers(args, target, out: Path, meta: dict, say):
    from specserve.speculative.train import data as tdata

    path = out / "data" / "answers.pt"
    if args.use_saved_answers:
        saved = tdata.load_answers(path, meta) if path.is_file() else {}
        if not saved:
            raise SpecserveError(f"--use-saved-answers: {path} holds no answers made with these data options")
        say(f"{len(saved)} saved answers in {path}")
        for extra in args.more_answers:
            before = len(saved)
            saved = tdata.merge_answers(saved, tdata.load_compatible_answers(Path(extra).expanduser(), meta))
            say(f"{len(saved) - before} more answers from {extra}")
        if args.max_answers is not None:
            saved = tdata.sample_answers(saved, args.max_answers, args.seed)
            say(f"training on a random {len(saved)} of them (--max-answers)")
        return tdata.trainable(saved)
    prompts = tdata.load_prompts(args.data, args.seed, args.prompts)
    say(f"{len(prompts)} prompts; generating the target's answers")
    t0 = time.perf_counter()
    answers = tdata.build_answers(target, prompts, max_new_tokens=args.max_new_tokens, max_len=args.seq_len,
                                  temperature=args.temperature, seed=args.seed, max_num_seqs=args.gen_batch,
                                  progress=say, path=path, meta=meta)
    say(f"answers ready in {time.perf_counter() - t0:.0f} s")
    return answers


def _examples(args, target, out: Path, answers_meta: dict, layers, final_norm: bool, say):
    """The training examples: the cached dataset if it matches, else answers + hidden capture."""
    from specserve.speculative.train import data as tdata

    data_path = out / "data" / "dataset.pt"
    meta = {**answers_meta, "method": args.method, "layers": list(layers), "final_norm": final_norm}
    if args.max_answers is not None:  # a subset is another dataset
        meta["max_answers"] = [args.max_answers, args.seed]
    if args.more_answers:  # and so is a superset
        meta["more_answers"] = [str(Path(f).expanduser().resolve()) for f in args.more_answers]
    if data_path.is_file():
        cached, cmeta = tdata.load_dataset(data_path)
        if cmeta == meta:
            say(f"using the cached dataset {data_path} ({len(cached)} sequences)")
            return cached
    answers = _answers(args, target, out, answers_meta, say)
    t0 = time.perf_counter()
    cuda = target.model.device.type == "cuda"  # CUDA: hidden states stay on the GPU, next to the drafter
    examples = tdata.examples_from_answers(target, answers, layers=layers, final_norm=final_norm, progress=say,
                                           max_batch_tokens=8192 if cuda else 2048,
                                           device=target.model.device if cuda else "cpu")
    if not args.no_data_cache:
        tdata.save_dataset(examples, data_path, meta)
    n_tok = sum(len(e.ids) - e.prompt_len for e in examples)
    say(f"dataset: {len(examples)} sequences, {n_tok} answer tokens, hidden states in "
        f"{time.perf_counter() - t0:.0f} s")
    return examples
