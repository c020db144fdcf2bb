"""Forward-pass cost vs the number of rows in the pass, per model and weight format.

    python benchmarks/decode_cost.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--formats none,int8,q4]
        [--rows 1,2,4,8,16] [--context 256] [--layout verify|batch] [--min-time 2] [--markdown cost.md]
        [--activations int8,fp32] [--paths fused,python] [--kv-dtypes fp32,int8]
        [--variants "label=cflags;label=cflags"] [--prefetch trial|t0|t1]

One forward of the full model (all layers + lm_head, logits for every row) is timed for M rows:
  verify: ONE sequence with M new tokens after --context cached tokens (the shape of verifying M-1
          drafted tokens: what speculation pays per step);
  batch:  M sequences with one new token each, every one after --context cached tokens
          (the shape of decoding M requests together).
t(M)/t(1) is what matters for speculation: with k drafts and mean acceptance length L, a step
yields L tokens for t(k+1), so speculation wins when L > t(k+1)/t(1) (ignoring drafting cost).
The row counts are interleaved within each round and the median per M is reported. The KV cache holds
random K/V rather than a real prefill: the values do not change the arithmetic, only the length does.
--activations int8,fp32 times both linear paths of the int8 / GGUF weights on the same loaded model
(int8: activations quantized, integer dot products, the default; fp32: weights dequantized and
multiplied with fp32 activations), interleaved within each round like the row counts.
--paths fused,python times the fused CPU decoder path (all layers in one C call, the default) and
the per-op Python path (Transformer.fused = False; bit-identical results) the same way.
--kv-dtypes fp32,bf16,int8 times the same forward over caches of those dtypes (long --context: the
cache's bytes are what a decode step reads besides the weights).
--prefetch: the weight streams' prefetch hint, chosen per model as an engine chooses it (``trial``,
the default: tune.HintTrial over one-row forwards before the timing) or forced (t0, t1); the table
names it. Before 2026-12-07 this script always ran at t1, which engines on Zen 5 no longer use.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from specserve.engine.builder import set_threads  # noqa: E402
from specserve.kernels import library  # noqa: E402
from specserve.kernels.tune import HintTrial  # noqa: E402
from specserve.models.layers import linears  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402
from specserve.engine.model_runner import BatchEntry, build_forward_batch  # noqa: E402
from specserve.models.transformer import ForwardBatch, KVCache  # noqa: E402

BLOCK = 16


def make_batch(m: int, context: int, layout: str, blocks_per_seq: int, vocab: int) -> ForwardBatch:
    """verify: one sequence's m rows after ``context`` tokens; decode: m sequences' one row each."""
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, vocab, (m,), generator=g, dtype=torch.int64).tolist()
    blocks = lambda s: [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))]  # noqa: E731
    if layout == "verify":
        entries = [BatchEntry(ids, context, blocks(0))]
    else:
        entries = [BatchEntry([t], context, blocks(s)) for s, t in enumerate(ids)]
    return build_forward_batch(entries, BLOCK, blocks_per_seq, list(range(m)), torch.device("cpu"))


def filled_cache(cfg, num_blocks: int, kv_dtype: str) -> KVCache:
    """A cache whose every slot holds random K/V (written as the engine writes them). The values do
    not change the arithmetic, but untouched zero pages would all map to one physical page, which
    stays in the CPU's caches and hides the cost of reading a long context from memory."""
    kv = KVCache.allocate(cfg, num_blocks, BLOCK, kv_dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    for layer in range(kv.num_layers):
        n = kv.k[layer].shape[0] * BLOCK  # a sliding layer's own pool may be smaller
        k, v = (torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
        kv.write(layer, torch.arange(n), k, v)
    return kv


def set_int_dot(model, on: bool) -> None:
    """Switch every int8 / GGUF linear weight between the two activation paths (benchmark only)."""
    for lin in linears(model):
        if hasattr(lin.weight, "int_dot"):
            lin.weight.int_dot = on


def set_case(model, act: str, path: str) -> None:
    set_int_dot(model, act == "int8")
    model.fused = path == "fused"


def timed_forward(model, batch: ForwardBatch, kv: KVCache, lib) -> float:
    """Seconds of one forward, with the kernel build ``lib`` (None: the chosen one)."""
    with library.using(lib) if lib is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        model.forward(batch, kv)
        return time.perf_counter() - t0


def set_hint(builds: dict, t0: bool) -> None:
    """The weight streams' prefetch hint, in the chosen build and in every build being compared."""
    library.set_prefetch_t0(t0)
    for lib in builds.values():
        if lib is not None:
            lib.ss_set_prefetch_t0(int(t0))


def prefetch_hint(model, mode: str, builds: dict, batch: ForwardBatch, kv: KVCache) -> dict:
    """Set the hint as an engine would (``trial``: tune.HintTrial over one-row forwards) or as
    --prefetch forces it; returns the record."""
    if mode != "trial":
        set_hint(builds, mode == "t0")
        return {"prefetch": mode, "source": "--prefetch"}
    trial = HintTrial(lambda on: set_hint(builds, on))
    while True:
        trial.before()
        rec = trial.after(1, timed_forward(model, batch, kv, None))
        if rec is not None:
            return rec


def measure(model_name: str, fmt: str, a: argparse.Namespace, builds: dict) -> list[dict]:
    """builds: label -> kernel library to time (``{"": None}``: the chosen build alone)."""
    t = time.perf_counter()
    lm = load_model(model_name, LoadOptions("cpu", "auto", fmt))
    load_s = time.perf_counter() - t
    cfg, model = lm.config, lm.model
    rows = [int(x) for x in a.rows.split(",")]
    acts = [x.strip() for x in a.activations.split(",")] if fmt != "none" else ["fp32"]
    paths = [x.strip() for x in a.paths.split(",")]
    kv_dtypes = [x.strip() for x in a.kv_dtypes.split(",")]
    bps = -(-(a.context + max(rows)) // BLOCK)
    n_seqs = 1 if a.layout == "verify" else max(rows)
    kvs = {d: filled_cache(cfg, bps * n_seqs, d) for d in kv_dtypes}
    batches = {m: make_batch(m, a.context, a.layout, bps, cfg.vocab_size) for m in rows}
    cases = [(act, path, d, b, m) for act in acts for path in paths for d in kv_dtypes for b in builds for m in rows]
    times: dict[tuple[str, str, str, str, int], list[float]] = {c: [] for c in cases}

    with torch.inference_mode():
        one = make_batch(1, a.context, "verify", bps, cfg.vocab_size)
        hint = prefetch_hint(model, a.prefetch, builds, one, kvs[kv_dtypes[0]])
        for act, path, d, b, m in cases:  # warm-up
            set_case(model, act, path)
            for _ in range(2):
                timed_forward(model, batches[m], kvs[d], builds[b])
        t_end, rnd = time.perf_counter() + a.min_time * len(cases), 0
        while rnd < a.min_rounds or (time.perf_counter() < t_end and rnd < a.max_rounds):
            for case in cases[rnd % len(cases):] + cases[:rnd % len(cases)]:
                act, path, d, b, m = case
                set_case(model, act, path)
                times[case].append(timed_forward(model, batches[m], kvs[d], builds[b]))
            rnd += 1
    model.fused = True
    out = []
    for act, path, d, b in [(act, path, d, b) for act in acts for path in paths for d in kv_dtypes for b in builds]:
        med = {m: statistics.median(times[(act, path, d, b, m)]) for m in rows}
        label = fmt if fmt == "none" else f"{fmt} ({act} act.)"
        label += f", {path}" if len(paths) > 1 or path != "fused" else ""
        label += f", {d} KV" if len(kv_dtypes) > 1 or d != "fp32" else ""
        label += f", {b}" if b else ""
        out.append({"model": model_name, "format": label, "weights_mb": model.weight_bytes() / 1e6,
                    "load_s": load_s, "rounds": rnd, "median_ms": {m: med[m] * 1e3 for m in rows},
                    "min_ms": {m: min(times[(act, path, d, b, m)]) * 1e3 for m in rows},
                    "ratio_vs_1": {m: med[m] / med[rows[0]] for m in rows}, "prefetch": hint})
    del lm, model, kvs, batches
    gc.collect()
    return out


def markdown(results: list[dict], a: argparse.Namespace, threads: int) -> str:
    rows = [int(x) for x in a.rows.split(",")]
    head = (f"Forward time (median ms) vs rows, layout {a.layout}, context {a.context}, {threads} threads. "
            f"t(M)/t(1) in brackets.")
    lines = [head, "", "| model | weights | MB | " + " | ".join(f"M={m}" for m in rows) + " | t(8)/t(1) |",
             "|---|---|---|" + "---|" * (len(rows) + 1)]
    hints = []
    for r in results:
        cells = [f"{r['median_ms'][m]:.1f} ({r['ratio_vs_1'][m]:.2f})" for m in rows]
        r8 = f"{r['ratio_vs_1'][8]:.2f}" if 8 in r["ratio_vs_1"] else "-"
        lines.append(f"| {r['model']} | {r['format']} | {r['weights_mb']:.0f} | " + " | ".join(cells) + f" | {r8} |")
        h = r["prefetch"]
        how = f"trial, median t0/t1 {h['t0_over_t1']}" if h["source"] == "measured" else h["source"]
        hints.append(f"{r['model']} {r['format']}: {h['prefetch']} ({how})")
    return "\n".join(lines) + "\n\nWeight prefetch hint: " + "; ".join(hints) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--formats", default="none,int8,q4")
    ap.add_argument("--rows", default="1,2,4,8,16", help="row counts M; the first is the baseline")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the new rows")
    ap.add_argument("--layout", choices=["verify", "batch"], default="verify")
    ap.add_argument("--min-time", type=float, default=2.0, help="seconds of timing per row count (at least)")
    ap.add_argument("--min-rounds", type=int, default=5)
    ap.add_argument("--max-rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    ap.add_argument("--activations", default="int8",
                    help="linear paths of int8 / GGUF weights to time: int8 (integer dot, default), fp32, or both")
    ap.add_argument("--paths", default="fused",
                    help="decoder paths to time: fused (one C call for all layers, default), python (per op), "
                         "or both")
    ap.add_argument("--kv-dtypes", default="fp32",
                    help="KV cache dtypes to time (--kv-cache-dtype values: fp32, bf16, fp16, fp8_e4m3, int8, "
                         "int4), interleaved like the row counts")
    ap.add_argument("--variants", default="",
                    help="kernel builds to compare, 'label=cflags;label=cflags' (e.g. 'pairs=-DQP_SINGLE_ROWS=0;"
                         "single='), interleaved like the row counts")
    ap.add_argument("--prefetch", choices=("trial", "t0", "t1"), default="trial",
                    help="the weight prefetch hint: chosen per model by the engine's trial over one-row "
                         "forwards (default), or forced; set in every build compared")
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    threads = set_threads(a.threads)
    builds = {label: library.build_with_flags(flags)
              for label, flags in (v.split("=", 1) for v in a.variants.split(";") if v)}
    results = []
    for model in a.models.split(","):
        for fmt in a.formats.split(","):
            for r in measure(model.strip(), fmt.strip(), a, builds or {"": None}):
                print(f"{r['model']} {r['format']}: " + "  ".join(
                    f"M={m} {v:.1f}ms" for m, v in r["median_ms"].items()) + f"  ({r['rounds']} rounds)",
                    file=sys.stderr, flush=True)
                results.append(r)
    md = markdown(results, a, threads)
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "threads": threads, "results": results}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
