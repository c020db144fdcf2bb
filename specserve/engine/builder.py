"""Build an engine from command-line flags (shared by generate, serve and bench --ab)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, replace

import torch

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.kernels import ops
from specserve.models.loader import LoadedModel, LoadOptions, load_model
from specserve.speculative.config import SpeculativeConfig, parse_speculative_config
from specserve.speculative.drafter import Drafter
from specserve.speculative.registry import build_drafter

logger = logging.getLogger("specserve.engine")


def set_threads(n: int | None) -> int:
    """Use the physical cores (or n): more threads than cores only adds contention."""
    import os

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
    set_threads(getattr(args, "threads", None))
    spec = parse_speculative_config(getattr(args, "speculative_config", None))
    options = LoadOptions(args.device, args.dtype, args.quantization)
    ecfg = EngineConfig.from_args(args)
    target = load_model(args.model, replace(options, mmproj=getattr(args, "mmproj", None)))
    max_len = ecfg.context_len(target.config.max_position)
    if ecfg.max_model_len and ecfg.max_model_len > max_len:
        logger.warning("--max-model-len %d is more than %s was trained for; using %d", ecfg.max_model_len,
                       target.name, max_len)
    return EngineParts(target, ecfg, spec, build_drafter(spec, target, options, ecfg, max_len))


def build_engine(args: argparse.Namespace) -> LLMEngine:
    parts = build_parts(args)
    return LLMEngine(parts.target, parts.ecfg, parts.speculative, parts.drafter)
