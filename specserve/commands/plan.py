"""``specserve plan``: the memory budget of a deployment, without serving it.

Prints the weights (in their run-time format, the drafter's included), the KV bytes per token
for ``--kv-cache-dtype``, the pool that fits, the longest context one sequence can use and how
many sequences fit at ``--max-model-len``. The numbers come from the engine's own planner
(:func:`specserve.engine.config.engine_plan`), so they are the pool ``serve`` allocates with the
same flags. ``--memory`` asks instead how a total budget (weights + KV) would split.
"""

from __future__ import annotations

import argparse
import json

from specserve.commands.args import add_engine_args, parse_bytes
from specserve.errors import SpecserveError
from specserve.server.fingerprint import weight_formats

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="print the memory budget: weights, KV per token, pool, context, concurrency",
                              description=__doc__.splitlines()[0].split(": ", 1)[-1])
    add_engine_args(p)
    p.add_argument("--memory", type=parse_bytes, default=None,
                   help="total bytes for weights + KV (e.g. 8GiB; default: the available memory, as the engine "
                        "computes it). --kv-cache-memory, when given, sizes the pool instead")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _mib(n: int) -> str:
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def format_plan(plan, title: str = "memory plan") -> str:
    """A few lines describing a MemoryPlan (printed by ``serve`` at start-up and by ``plan``)."""
    source = {"--kv-cache-memory": "set by --kv-cache-memory", "--memory": "what --memory leaves",
              "available": f"sized from {_mib(plan.available_bytes)} available"}.get(plan.pool_source, plan.pool_source)
    conc = plan.concurrency_at(plan.max_model_len)
    lines = [
        f"{title}: weights {_mib(plan.weight_bytes)}"
        + (f" + drafter {_mib(plan.drafter_bytes)}" if plan.drafter_bytes else "")
        + (f" + drafter KV {_mib(plan.drafter_kv_bytes)}" if plan.drafter_kv_bytes else "")
        + f" + KV pool {_mib(plan.pool_bytes)}"
        + (f" + recurrent states {_mib(plan.state_bytes)}" if plan.state_bytes else "")
        + (f" + vision {_mib(plan.vision_bytes)}" if plan.vision_bytes else "")
        + f" = {_mib(plan.total_bytes)}",
        f"  KV cache: {plan.kv_dtype}, {plan.kv_bytes_per_token:,} bytes/token"
        + (" (global layers only)" if plan.sliding_window else "")
        + (" (full-attention layers only)" if plan.state_bytes else "")
        + f"; pool {plan.pool_tokens:,} tokens ({plan.num_blocks:,} blocks of {plan.block_size}; {source})",
    ]
    if plan.sliding_window:
        lines.append(f"  sliding-window layers: window {plan.sliding_window:,} tokens, fixed pool "
                     f"{_mib(plan.window_bytes)} ({plan.window_blocks:,} blocks, for --max-num-seqs {plan.max_num_seqs})")
    if plan.state_bytes:
        lines.append(f"  recurrent states (linear-attention layers, float32): {plan.state_slots} slots (--max-num-seqs "
                     f"{plan.max_num_seqs} + 1) x {plan.state_planes} planes (the committed state and one snapshot "
                     f"per row a step verifies)"
                     + (f" + {plan.state_checkpoints} prefix-cache checkpoints" if plan.state_checkpoints else "")
                     + f" = {_mib(plan.state_bytes)}, fixed")
    if plan.vision_bytes:
        lines.append(f"  vision tower: weights {_mib(plan.vision_weight_bytes)} + activations of the largest image "
                     f"{_mib(plan.vision_activation_bytes)} + encoder-output cache {_mib(plan.encoder_cache_bytes)}, "
                     "counted before the first image arrives")
    lines += [
        f"  max context for one sequence: {plan.max_context:,} tokens; at --max-model-len {plan.max_model_len:,}: "
        f"{conc:,} sequence{'s fit' if conc != 1 else ' fits'}"
        + (f" (--max-num-seqs {plan.max_num_seqs})" if plan.max_num_seqs else ""),
    ]
    return "\n".join(lines)


def compute_plan(args: argparse.Namespace) -> tuple[object, dict]:
    """Load the model (and build the drafter) as the engine would, and plan its memory.
    Returns (MemoryPlan, extra facts for the report)."""
    from specserve.engine.builder import build_parts
    from specserve.engine.llm_engine import plan_for

    if args.memory is not None and args.memory <= 0:
        raise SpecserveError("--memory must be a positive number of bytes")
    if args.tensor_parallel_size > 1:
        return rank_plans(args)
    parts = build_parts(args)
    target, spec, model = parts.target, parts.speculative, parts.target.model
    plan = plan_for(target, parts.ecfg, spec, parts.drafter, total_memory=args.memory)
    formats = weight_formats(model)
    extra = {"model": target.name, "device": str(model.device), "weight_format": ",".join(formats),
             "speculative_method": spec.method if spec else None, "model_max_len": target.config.max_position,
             "memory": args.memory}
    return plan, extra


def rank_plans(args: argparse.Namespace) -> tuple[list, dict]:
    """-tp N: each rank's plan, its shard loaded here one after another (no process started).
    Rank 0 holds the drafter; every rank holds the same KV blocks of its own heads; the ranks of
    one machine share its memory (--memory / the available memory split between them)."""
    from dataclasses import replace

    from specserve.engine.builder import _parts
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import plan_for
    from specserve.models.loader import LoadOptions, load_model
    from specserve.parallel.launch import ParallelConfig, ranks_sharing_memory
    from specserve.parallel.shard import Shard
    from specserve.speculative.config import parse_speculative_config

    pcfg = ParallelConfig.from_args(args)
    n, ecfg = pcfg.tensor_parallel_size, EngineConfig.from_args(args)
    spec = parse_speculative_config(getattr(args, "speculative_config", None))
    options = LoadOptions(args.device, args.dtype, args.quantization)
    plans = []
    for rank in range(n):
        target = load_model(args.model, replace(options, shard=Shard(rank, n)))
        share = ranks_sharing_memory(len(pcfg.local_ranks), target.model.device)
        parts = _parts(target, ecfg, spec if rank == 0 else None, options)
        plan = plan_for(target, ecfg, parts.speculative, parts.drafter, total_memory=args.memory, share=share)
        if plans:  # the driver's pool is every rank's
            plan = replace(plan, num_blocks=plans[0].num_blocks)
        plans.append(plan)
        del target, parts
    extra = {"model": args.model, "device": args.device, "tensor_parallel_size": n,
             "speculative_method": spec.method if spec else None, "memory": args.memory}
    return plans, extra


def run(args: argparse.Namespace) -> int:
    plan, extra = compute_plan(args)
    if isinstance(plan, list):
        return _print_rank_plans(plan, extra, args.json)
    if args.json:
        print(json.dumps({**extra, **plan.to_dict()}, indent=2))
        return 0
    print(f"{extra['model']} on {extra['device']}: weights in {extra['weight_format']}"
          + (f", speculation: {extra['speculative_method']}" if extra["speculative_method"] else ""))
    print(format_plan(plan))
    return 0


def _print_rank_plans(plans: list, extra: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps({**extra, "ranks": [p.to_dict() for p in plans],
                          "total_bytes": sum(p.total_bytes for p in plans)}, indent=2))
        return 0
    print(f"{extra['model']}, tensor parallel over {extra['tensor_parallel_size']} ranks"
          + (f", speculation: {extra['speculative_method']} (on rank 0)" if extra["speculative_method"] else ""))
    for rank, plan in enumerate(plans):
        print(format_plan(plan, title=f"rank {rank}"))
    print(f"all ranks: {_mib(sum(p.total_bytes for p in plans))}")
    return 0
