"""Flags shared by the commands that build an engine (generate, serve, plan, lock).

Names follow vLLM where vLLM has the flag.
"""

from __future__ import annotations

import argparse
import math
import os
import re

from specserve.engine.step_budget import DEFAULT_MAX_STEP_MS
from specserve.models.quant import QUANTIZATIONS
from specserve.parallel.launch import add_parallel_args

DEFAULT_MODEL = "smollm2-135m"
MAX_THREADS = 1024
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
MAX_BYTES = 2**50  # 1 PiB: more is a typo
# vLLM's spellings of --kv-cache-dtype (its fp8 is e4m3 by default)
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16"}


def int_in(lo: int, hi: int | None = None):
    """argparse type: an int in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def float_where(ok, bound: str):
    """argparse type: a float for which ok(value) holds (NaN never does); ``bound`` says which."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


fraction = float_where(lambda v: 0 < v <= 1, "in (0, 1]")
positive_float = float_where(lambda v: 0 < v < math.inf, "a positive number")
nonnegative_float = float_where(lambda v: 0 <= v < math.inf, "a number >= 0")


def parse_bytes(text: str) -> int:
    """'123', '4GiB', '512MiB', '1.5GB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 8589934592, 8GiB, 512MiB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 1 PiB")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="catalog name, local GGUF file, local Hugging Face directory or hub repo id")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when torch sees a GPU")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="run-time weight format (auto: the fastest exact-kernel format for the device; "
                        "q4_0: every linear in 4 bits, re-quantizing other types, for draft models)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="llama.cpp mmproj GGUF: the vision tower of a GGUF model (a safetensors checkpoint "
                        "carries its own)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'')
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per forward pass (prefill chunk size)")
    p.add_argument("--max-step-ms", type=nonnegative_float, default=DEFAULT_MAX_STEP_MS,
                   help="while streams decode, size prefill chunks so one step's forward takes about this "
                        "long, from measured costs (0: fixed --max-num-batched-tokens chunks)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV pool size in bytes (e.g. 2GiB, 512MiB)")
    p.add_argument("--encoder-cache-memory", type=parse_bytes, default=256 << 20,
                   help="image embeddings kept by image content, so a repeated image is not encoded again "
                        "(models with a vision tower; counted in the memory plan)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of free memory for weights + KV when --kv-cache-memory is unset")
    p.add_argument("--kv-cache-dtype", default="auto", type=lambda v: KV_DTYPE_ALIASES.get(v, v),
                   choices=["auto", "fp32", "bf16", "fp16", "fp8_e4m3", "int8", "int4"],
                   help="KV cache storage (auto: fp32 on CPU, the activation dtype on CUDA); fp8_e4m3 / int8: "
                        "per-token scales, int4: groups of 32 (CPU only); see specserve/models/kv_cache.py")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the K/V of prompt prefixes that earlier requests computed")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without one")
    p.add_argument("--threads", type=int_in(0, MAX_THREADS), default=None,
                   help="CPU threads (default or 0: the cores this process may use; under tensor parallel: "
                        "per rank, default the cores shared by this machine's ranks)")
    add_parallel_args(p)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``specserve serve`` (also parsed by ``specserve lock -- ...``)."""
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on ('' or 0.0.0.0: every interface)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000, help="port to listen on")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names requests may give as model; answers report the first (default: the "
                        "model's name, and the --model value as given)")
    p.add_argument("--chat-template", default=None,
                   help="jinja file replacing the model's template, or the template itself inline")
    p.add_argument("--default-chat-template-kwargs", default=None,
                   help="JSON object of template variables; a request's chat_template_kwargs override them")
    p.add_argument("--reasoning-parser", default="none", choices=["none", "qwen3", "deepseek_r1"],
                   help="split <think> text into reasoning_content")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "none"],
                   help="read tool calls out of chat output (auto: hermes when the chat template writes "
                        "<tool_call> tags; none: calls stay text)")
    env_key = os.environ.get("SPECSERVE_API_KEY") or None
    p.add_argument("--api-key", nargs="+", metavar="KEY", default=[env_key] if env_key else None,
                   help="keys a request may send, as 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'; several "
                        "as vLLM's (--api-key A B) or llama-server's (A,B) (default: $SPECSERVE_API_KEY, "
                        "which keeps it out of the process list, as vLLM's $VLLM_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="more keys, one a line (# starts a comment), as llama-server's")
    p.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get a 413")
    p.add_argument("--max-n", type=int, default=8, help="largest n a request may ask for")
    p.add_argument("--max-stored-responses", type=int, default=1000,
                   help="/v1/responses kept in memory for previous_response_id (least recently used go first)")
    p.add_argument("--allowed-origins", default='["*"]', help="CORS: JSON list of origins allowed to call the API")
    p.add_argument("--allowed-methods", default='["*"]', help="CORS: JSON list of allowed methods")
    p.add_argument("--allowed-headers", default='["*"]', help="CORS: JSON list of allowed request headers")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and auth headers")
    p.add_argument("--disable-fastapi-docs", action="store_true", help="serve no /openapi.json and no /docs")
    p.add_argument("--allowed-media-domains", default=None,
                   help="JSON list (or comma-separated) of hosts image URLs may be fetched from; without it "
                        "only data: URLs are read")
    p.add_argument("--limit-mm-per-prompt", default=None,
                   help='most images a prompt may carry, JSON \'{"image": 8}\' (default 8)')
    p.add_argument("--media-fetch-timeout", type=float, default=10.0,
                   help="seconds an image download may take")
    p.add_argument("--max-image-bytes", type=parse_bytes, default=20 << 20,
                   help="largest encoded image a request may send or the server may download")
    p.add_argument("--max-image-pixels", type=int, default=64 << 20,
                   help="largest decoded image (width x height) a request may send; larger is a 400 (the model's "
                        "preprocessing then resizes what is accepted to its own pixel limits)")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="seconds a structured-outputs grammar (JSON schema, regex, ...) may take to compile; "
                        "longer is a 400")
    p.add_argument("--lock", default=None, help="deployment lock file to verify before starting")
    p.add_argument("--lock-allow", action="append", default=[], help="lock field allowed to drift")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.add_argument("--shutdown-timeout", type=nonnegative_float, default=30.0,
                   help="on SIGTERM / SIGINT, seconds the running requests may still take before they are "
                        "ended with an error (0: end them at once; a second signal also does)")


def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve serve", add_help=False)
    add_serve_args(p)
    return p
