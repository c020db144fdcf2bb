"""Flags shared by the commands that build an engine (generate, serve, plan, lock).

Names follow vLLM where vLLM has the flag.
"""

from __future__ import annotations

import argparse

from specserve.models.quant import QUANTIZATIONS

DEFAULT_MODEL = "smollm2-135m"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="catalog name, local GGUF file, local Hugging Face directory or hub repo id")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="run-time weight format (auto: the fastest exact-kernel format for the device; "
                        "q4_0: every linear in 4 bits, re-quantizing other types, for draft models)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'')
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per forward pass (prefill chunk size)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of free memory for weights + KV when --kv-cache-memory is unset")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp32", "bf16", "fp16", "fp8_e4m3", "int8", "int4"],
                   help="KV cache storage (auto: fp32 on CPU, the activation dtype on CUDA); fp8_e4m3 / int8: "
                        "per-token scales, int4: groups of 32 (CPU only); see specserve/models/kv_cache.py")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without one")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``specserve serve`` (also parsed by ``specserve lock -- ...``)."""
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--chat-template", default=None, help="jinja file replacing the model's template")
    p.add_argument("--default-chat-template-kwargs", default=None,
                   help="JSON object of template variables; a request's chat_template_kwargs override them")
    p.add_argument("--reasoning-parser", default="none", choices=["none", "qwen3", "deepseek_r1"])
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "none"],
                   help="read tool calls out of chat output (auto: hermes when the chat template writes "
                        "<tool_call> tags; none: calls stay text)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--max-n", type=int, default=8, help="largest n a request may ask for")
    p.add_argument("--lock", default=None, help="deployment lock file to verify before starting")
    p.add_argument("--lock-allow", action="append", default=[], help="lock field allowed to drift")
    p.add_argument("--log-level", default="info")


def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve serve", add_help=False)
    add_serve_args(p)
    return p
