"""Timing of the batch-invariant CPU kernels vs torch.

    nice -n 5 python benchmarks/kernel_times.py [--threads 2] [--rows 1,8] [--shapes 0,1] [--formats f32,int8,q4_0]
        [--activations int8,fp32] [--attention [--kv-dtypes fp32,bf16,int8]]

Prints one table: time per call (ms, best of the repeats: the least noisy
statistic on a shared machine) for each layer shape, weight format and row
count M, next to torch's fp32 F.linear (which is not batch invariant).
--activations fp32 (or int8,fp32) also times the int8 / GGUF formats on their
fp32-activation path (weight.int_dot = False, rows marked "/fp32a"); the
default int8 is their integer-dot path.

(Not named kernels.py: a script's directory is sys.path[0], and transformers imports any module
named ``kernels`` it can find, so that name broke every benchmark that builds a transformers model.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specserve.kernels import ops  # noqa: E402

SHAPES = [
    # name, N (out), K (in)
    ("smollm2 lm_head", 49152, 576),
    ("smollm2 mlp up", 1536, 576),
    ("smollm2 mlp down", 576, 1536),
    ("qwen2.5-1.5b mlp up", 8960, 1536),
    ("qwen2.5-1.5b mlp down", 1536, 8960),
]
FORMATS = ["f32", "int8", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]


def make_weight(fmt: str, w: torch.Tensor):
    if fmt == "f32":
        return ops.F32Weight.from_float(w)
    if fmt == "int8":
        return ops.Int8Weight.from_float(w)
    if fmt in ("q8_0", "q4_0", "q4_1"):
        return ops.GGUFBlockWeight.from_float(w, fmt.upper())
    # K-quants: random valid bytes (gguf-py has no quantizer for them)
    import numpy as np

    _, be, bb = ops.GGUF_QTYPES[fmt.upper()]
    n, k = w.shape
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // be, bb), dtype=np.uint8)
    d = (rng.random((n, k // be)) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // be, 2)
    if fmt == "q4_k":
        raw[..., 0:2] = d
        raw[..., 2:4] = d
    else:
        raw[..., 208:210] = d
    return ops.GGUFBlockWeight.from_raw(torch.from_numpy(raw.reshape(n, -1)), fmt.upper(), n, k)


CLOCK = time.perf_counter


def kv_cache(c: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An fp32 cache pool in kv_dtype's storage, with its scales (None for fp32)."""
    return (c, None) if kv_dtype == "fp32" else ops.kv_quantize(c, kv_dtype)


def bench(fn, min_time: float, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + min_time
    while True:
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
        if time.perf_counter() > t_end and len(times) >= 5:
            break
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default="", help="comma separated indices into SHAPES (default all)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--attention", action="store_true", help="also time paged attention / rms_norm")
    ap.add_argument("--kv-dtypes", default="fp32", help="KV cache formats the attention is timed on, e.g. "
                    "fp32,bf16,int8")
    ap.add_argument("--activations", default="int8",
                    help="paths of the int8 / GGUF formats: int8 (integer dot, the default), fp32, or both")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread: CPU time of the calling thread (robust on a busy machine; "
                         "only meaningful with --threads 1)")
    args = ap.parse_args()
    global CLOCK
    if args.clock == "thread":
        if args.threads != 1:
            ap.error("--clock thread needs --threads 1")
        CLOCK = time.thread_time

    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    info = ops.kernels_info()
    print(f"# threads={args.threads} clock={args.clock} avx2={info['avx2']} avx512={info.get('avx512')} "
          f"int_dot={info.get('int_dot')} "
          f"flags={' '.join(info['flags'])}")
    if not info["available"]:
        print("# C kernels unavailable:", info["error"])
    rows = [int(r) for r in args.rows.split(",")]
    fmts = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    shapes = SHAPES if not args.shapes else [SHAPES[int(i)] for i in args.shapes.split(",")]
    torch.manual_seed(0)

    hdr = f"{'layer':24s} {'N x K':>12s} {'format':>11s} " + " ".join(f"{'M=' + str(m):>9s}" for m in rows)
    print(hdr + "   (ms per call, best of repeats)")
    print("-" * len(hdr))
    for name, n, k in shapes:
        w = torch.randn(n, k) * 0.05
        xs = {m: torch.randn(m, k) for m in rows}
        cells = []
        for m in rows:
            cells.append(bench(lambda m=m, w=w: F.linear(xs[m], w), args.min_time))
        print(f"{name:24s} {f'{n}x{k}':>12s} {'torch':>11s} " + " ".join(f"{c:9.3f}" for c in cells))
        for fmt in fmts:
            if fmt.upper() in ops.GGUF_QTYPES and k % ops.GGUF_QTYPES[fmt.upper()][1]:
                print(f"{'':24s} {'':>12s} {fmt:>11s} " + " ".join(f"{'n/a':>9s}" for _ in rows))
                continue
            wt = make_weight(fmt, w)
            for act in ([a.strip() for a in args.activations.split(",")] if fmt != "f32" else ["fp32"]):
                if fmt != "f32":
                    wt.int_dot = act == "int8"
                cells = []
                for m in rows:
                    cells.append(bench(lambda m=m, wt=wt: ops.linear(xs[m], wt, impl="c"), args.min_time))
                label = fmt if fmt == "f32" or act == "int8" else f"{fmt}/fp32a"
                print(f"{'':24s} {'':>12s} {label:>11s} " + " ".join(f"{c:9.3f}" for c in cells))
            del wt
        del w

    if args.attention:
        print()
        kv_dtypes = [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
        print(f"{'paged_attention':24s} {'T':>5s} {'ctx':>6s} {'Hq/Hkv':>7s} {'D':>4s} "
              + " ".join(f"{k:>9s}" for k in kv_dtypes) + "   (ms)")
        for (hq, hkv, d) in [(9, 3, 64), (12, 2, 128), (8, 4, 256)]:
            for t, ctx in [(1, 1024), (1, 2048), (8, 1024), (256, 256)]:
                bs = 16
                nblk = (ctx + bs - 1) // bs + 1
                kc = torch.randn(nblk, bs, hkv, d)
                vc = torch.randn(nblk, bs, hkv, d)
                bt = torch.randperm(nblk)[: nblk].to(torch.int32).reshape(1, -1)
                q = torch.randn(t, hq, d)
                pos = torch.arange(ctx - t, ctx, dtype=torch.int32)
                sid = torch.zeros(t, dtype=torch.int32)
                cells = []
                for kvd in kv_dtypes:
                    (kq, ks), (vq, vs) = kv_cache(kc, kvd), kv_cache(vc, kvd)
                    cells.append(bench(lambda: ops.paged_attention(q, kq, vq, bt, sid, pos, d ** -0.5, impl="c",
                                                                   kv_dtype=kvd, k_scales=ks, v_scales=vs),
                                       args.min_time))
                print(f"{'':24s} {t:5d} {ctx:6d} {f'{hq}/{hkv}':>7s} {d:4d} " + " ".join(f"{c:9.3f}" for c in cells))
        print()
        for m, k in [(1, 576), (8, 1536), (512, 576)]:
            x = torch.randn(m, k)
            wn = torch.randn(k)
            a = bench(lambda: ops.rms_norm(x, wn, 1e-6, impl="c"), args.min_time)
            b = bench(lambda: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * wn, args.min_time)
            print(f"{'rms_norm':24s} M={m:<4d} K={k:<5d} ours {a:8.4f} ms   torch {b:8.4f} ms")


if __name__ == "__main__":
    main()
