"""Build an engine from command-line flags (shared by generate, serve and bench --ab)."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, replace

import torch

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.kernels import ops
from specserve.models.loader import LoadedModel, LoadOptions, load_model
from specserve.bench.serverproc import free_port
from specserve.parallel.launch import ParallelConfig, connect, pin, start_workers, watch
from specserve.parallel.shard import Shard
from specserve.speculative.config import SpeculativeConfig, parse_speculative_config
from specserve.speculative.drafter import Drafter
from specserve.speculative.registry import build_drafter

logger = logging.getLogger("specserve.engine")


def set_threads(n: int | None) -> int:
    """Use the physical cores (or n): more threads than cores only adds contention."""
    n = n or max(1, len(os.sched_getaffinity(0)))
    torch.set_num_threads(n)
    ops.set_num_threads(n)
    return n


@dataclass(frozen=True)
class EngineParts:
    """What an engine is made of, built from the flags (also what ``specserve plan`` plans)."""

    target: LoadedModel
    ecfg: EngineConfig
    speculative: SpeculativeConfig | None
    drafter: Drafter | None


def build_parts(args: argparse.Namespace) -> EngineParts:
    pcfg = ParallelConfig.from_args(args)
    tp_size = pcfg.tensor_parallel_size
    set_threads(pcfg.threads_per_rank(getattr(args, "threads", None)) if tp_size > 1 else getattr(args, "threads", None))
    spec = parse_speculative_config(getattr(args, "speculative_config", None))
    options = LoadOptions(args.device, args.dtype, args.quantization)
    ecfg = EngineConfig.from_args(args)
    if tp_size == 1:
        target = load_model(args.model, replace(options, mmproj=getattr(args, "mmproj", None)))
        return _parts(target, ecfg, spec, options)
    addr = pcfg.dist_init_addr or f"127.0.0.1:{free_port()}"
    cores = len(os.sched_getaffinity(0))
    on_cpu = options.device == "cpu" or (options.device == "auto" and not torch.cuda.is_available())
    if on_cpu and cores < len(pcfg.local_ranks):
        logger.warning("%d ranks on %d cores: they share the cores unpinned and wait on each other in every "
                    "collective, slower than fewer ranks", len(pcfg.local_ranks), cores)
    procs = start_workers(args, pcfg, addr)  # they load their shards while this process loads its own
    pin(pcfg.core_sets().get(0))
    try:
        target = load_model(args.model, replace(options, shard=Shard(0, tp_size), mmproj=getattr(args, "mmproj", None)))
        # the group first: a drafter built on the target (a cut of its LM head) calls into every rank
        target.model.attach_tensor_parallel(connect(0, pcfg, addr, procs, target.model.device))
        parts = _parts(target, ecfg, spec, options)
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    watch(target.model.tp)
    return parts


def _parts(target: LoadedModel, ecfg: EngineConfig, spec: SpeculativeConfig | None, options: LoadOptions) -> EngineParts:
    max_len = ecfg.context_len(target.config.max_position)
    if ecfg.max_model_len and ecfg.max_model_len > max_len:
        logger.warning("--max-model-len %d is more than %s was trained for; using %d", ecfg.max_model_len,
                       target.name, max_len)
    return EngineParts(target, ecfg, spec, build_drafter(spec, target, options, ecfg, max_len))


def build_engine(args: argparse.Namespace) -> LLMEngine:
    parts = build_parts(args)
    return LLMEngine(parts.target, parts.ecfg, parts.speculative, parts.drafter)
