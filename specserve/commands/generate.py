"""``specserve generate``: one prompt, streamed, with a timing line at the end."""

from __future__ import annotations

import argparse
import json
import sys
import time

from specserve.commands.args import add_engine_args


DEFAULT_MAX_TOKENS = 256


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(p)
    p.set_defaults(max_num_seqs=1)
    p.add_argument("prompt", help="the user message (or raw text with --raw); - reads it from standard input")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}, or what the context has left; "
                        "-1: up to the end of the context)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--raw", action="store_true", help="no chat template: complete the text as given")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image (PNG, JPEG, WebP) before the prompt in the user message (repeatable; a model "
                        "with a vision tower, or a GGUF with --mmproj)")
    p.set_defaults(func=run)


def _images(engine, args) -> list:
    """The --image files, preprocessed for the model (SpecserveError naming what is wrong)."""
    from pathlib import Path

    from specserve.errors import RequestError, SpecserveError
    from specserve.server.media import MediaConfig, MediaLoader

    if not args.image:
        return []
    target = engine.target
    if target.vision is None or args.raw:
        raise SpecserveError("--image needs a model with a vision tower (a GGUF takes one with --mmproj) and a chat "
                             "prompt (not --raw)")
    loader = MediaLoader(MediaConfig(max_images=len(args.image)), target.image_processor,
                         target.vision.config.spatial_merge_size)
    try:
        return loader.preprocess([(Path(f).read_bytes(), f"--image {f}") for f in args.image])
    except OSError as exc:
        raise SpecserveError(f"cannot read --image {exc.filename}: {exc.strerror}") from exc
    except RequestError as exc:
        raise SpecserveError(str(exc)) from exc


def _prompt_ids(engine, args, images: list) -> list[int]:
    tok = engine.tokenizer
    if not args.raw and not tok.chat_template:
        print(f"warning: {args.model} has no chat template; completing the raw text (pass --raw to silence this)",
              file=sys.stderr)
        args.raw = True
    if args.raw:
        return tok.encode(args.prompt, add_special_tokens=True)
    from specserve.models.chat_template import ChatTemplate

    from specserve.server.media import IMAGE_MARK, expand_images

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": IMAGE_MARK * len(images) + args.prompt.replace(IMAGE_MARK, "")}]
    text = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token).render(messages)
    if images:
        return expand_images(tok, text, images, engine.target.vision.config)
    return tok.encode(text, add_special_tokens=False)


def run(args: argparse.Namespace) -> int:
    from specserve.engine.builder import build_engine

    engine = build_engine(args)
    try:
        return _generate(engine, args)
    finally:
        engine.close()  # (a tensor-parallel group's workers)


def _generate(engine, args: argparse.Namespace) -> int:
    from specserve.engine.types import SamplingParams

    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    images = _images(engine, args)
    ids = _prompt_ids(engine, args, images)
    left = max(1, engine.max_model_len - len(ids))  # what the context leaves after the prompt
    max_tokens = args.max_tokens
    if max_tokens is None:  # the default, within that
        max_tokens = min(DEFAULT_MAX_TOKENS, left)
    elif max_tokens < 0:  # llama-cli's -n -1: until the end of the text or the context
        max_tokens = left
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    text, token_ids, last = [], [], None
    for out in engine.generate(ids, params, images=images or None):
        text.append(out.new_text)
        token_ids += out.new_token_ids
        last = out
        if not args.json:
            print(out.new_text, end="", flush=True)
    total = time.perf_counter() - t0
    _report(args, "".join(text), token_ids, last, total, engine)
    return 0


def _report(args, text: str, token_ids: list[int], last, total: float, engine) -> None:
    prefill_s = last.prefill_time
    decode_s = max(last.decode_time, 1e-9)
    n_prompt, n_out = last.prompt_tokens, last.completion_tokens
    prefill_tps = (n_prompt - last.cached_tokens) / prefill_s if prefill_s else 0.0
    decode_tps = (n_out - 1) / decode_s if n_out > 1 else 0.0
    if args.json:
        obj = {"text": text, "token_ids": token_ids, "finish_reason": last.finish_reason,
               "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out},
               "timings": {"prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
                           "total_s": total}}
        if last.acceptance is not None:
            obj["speculative"] = last.acceptance.to_dict()
        print(json.dumps(obj))
        return
    print()
    print(f"[prompt tokens: {n_prompt}, completion tokens: {n_out}, prefill: {prefill_tps:.1f} tok/s, "
          f"decode: {decode_tps:.1f} tok/s]", file=sys.stderr)
    if last.acceptance is not None:
        print(last.acceptance.line(), file=sys.stderr)
