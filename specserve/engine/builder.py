"""Build an engine from command-line flags (shared by generate, serve and bench --ab)."""

from __future__ import annotations

import argparse
import logging

import torch

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.kernels import ops
from specserve.models.loader import LoadOptions, load_model
from specserve.spec.config import parse_spec_config
from specserve.spec.registry import build_drafter

logger = logging.getLogger("specserve.engine")


def set_threads(n: int | None) -> int:
    """Use the physical cores (or n): more threads than cores only adds contention."""
    import os

    n = n or max(1, len(os.sched_getaffinity(0)))
    torch.set_num_threads(n)
    ops.set_num_threads(n)
    return n


def build_engine(args: argparse.Namespace) -> LLMEngine:
    set_threads(getattr(args, "threads", None))
    spec = parse_spec_config(getattr(args, "speculative_config", None))
    options = LoadOptions(args.device, args.dtype, args.quantization)
    ecfg = EngineConfig.from_args(args)
    target = load_model(args.model, options)
    max_len = min(ecfg.max_model_len or target.config.max_position, target.config.max_position)
    if ecfg.max_model_len and ecfg.max_model_len > max_len:
        logger.warning("--max-model-len %d is more than %s was trained for; using %d", ecfg.max_model_len,
                       target.name, max_len)
    drafter = build_drafter(spec, target, options, ecfg, max_len)
    return LLMEngine(target, ecfg, spec, drafter)
