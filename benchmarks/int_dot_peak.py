"""This CPU's int8 dot-product peak, and how close our integer-dot linears get to it.

    python benchmarks/int_dot_peak.py [--threads 2] [--rows 1,8,16] [--formats Q4_K,Q6_K,Q8_0,Q4_1]
        [--n 131072] [--k 1536] [--rounds 20] [--read-mb 1024] [--models smollm2-135m,...] [--context 512]
        [--markdown peak.md] [--out peak.json]

1. Peak: a tiny C loop (built with gcc -march=native, one OpenMP thread per core asked for) of 12
   independent accumulator chains of the widest int8 dot instruction this CPU has (AVX-512 VNNI
   vpdpbusd on zmm, AVX-VNNI, or AVX2 maddubs + madd + add; then the narrower ones this CPU also
   has), timed over ~0.3 s, best of 5: int8 multiply-adds per second with every operand in
   registers, the ceiling no kernel passes.
2. Memory: the bytes per second torch's sum reads from --read-mb MB of float32 on the same
   threads (weight_stream.py's plain read), in huge pages where the OS gives them, as our weights
   are: roughly the ceiling of a one-row forward, which reads every weight once.
3. Our linears: one N x K weight of each format (random blocks, repacked as at load) at each row
   count, timed the same way the models call them (``specserve.kernels.linear.linear``, median of
   the rounds): ms, GB/s of weight bytes streamed, and multiply-adds per second as a share of the
   peak (the compute bound: at 8 rows a Q4_K linear does 8 int8 multiply-adds per weight).
4. With --models: each model's one-row and 8-row forwards (the verify shape of decode_cost.py at
   --context, taking turns with a plain read pass, median of --rounds) beside two floors: its
   linears' weight bytes plus the fp32 K/V its attention reads, at the read speed of the same
   rounds, and the linears' int8 multiply-adds (8 per weight at 8 rows) at the peak. Attention's
   arithmetic, the norms and the rest come on top of both.

The ratio says whether a verification's extra rows are bound by arithmetic (share near 100%), by
the weight stream (GB/s near the read ceiling), or by neither (what the kernel spends elsewhere).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

PEAK_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define CHAINS 12
#if defined(__AVX512VNNI__) && !defined(PEAK_YMM) && !defined(PEAK_AVX2)
#define V __m512i
#define ZERO _mm512_setzero_si512()
#define SET(x) _mm512_set1_epi32(x)
#define LANES 64
#define OUT(a) _mm512_reduce_add_epi32(a)
#define STEP(a, u, s) asm volatile("vpdpbusd %2, %1, %0" : "+v"(a) : "v"(u), "v"(s))
const char *kind = "avx512-vnni zmm (vpdpbusd)";
#elif defined(__AVX2__)
#define V __m256i
#define ZERO _mm256_setzero_si256()
#define SET(x) _mm256_set1_epi32(x)
#define LANES 32
#define OUT(a) _mm256_extract_epi32(a, 0)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(PEAK_AVX2)
#define STEP(a, u, s) asm volatile("vpdpbusd %2, %1, %0" : "+v"(a) : "v"(u), "v"(s))
const char *kind = "avx512-vnni ymm (vpdpbusd)";
#elif defined(__AVXVNNI__) && !defined(PEAK_AVX2)
#define STEP(a, u, s) asm volatile("{vex} vpdpbusd %2, %1, %0" : "+v"(a) : "v"(u), "v"(s))
const char *kind = "avx-vnni ymm (vpdpbusd)";
#else
#define PEAK_MADDUBS 1
#define STEP(a, u, s) do { V t_; asm volatile("vpmaddubsw %2, %1, %0" : "=x"(t_) : "x"(u), "x"(s)); \
    asm volatile("vpmaddwd %1, %0, %0" : "+x"(t_) : "x"(one)); a = _mm256_add_epi32(a, t_); } while (0)
const char *kind = "avx2 ymm (maddubs + madd + add)";
#endif
#else
#error "no SIMD int8 dot product"
#endif

/* int8 multiply-adds per second of nthreads threads, each running iters steps of CHAINS chains */
double peak(int nthreads, int64_t iters, volatile int *sink) {
    double t0 = omp_get_wtime();
    #pragma omp parallel num_threads(nthreads)
    {
        const V u = SET(0x01020304), s = SET(0x05060708);
#ifdef PEAK_MADDUBS
        const V one = _mm256_set1_epi16(1);
#endif
        /* the chains in named variables: asm operands that are array elements went through memory */
        V a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, a4 = ZERO, a5 = ZERO;
        V a6 = ZERO, a7 = ZERO, a8 = ZERO, a9 = ZERO, a10 = ZERO, a11 = ZERO;
        for (int64_t i = 0; i < iters; i++) {
            STEP(a0, u, s); STEP(a1, u, s); STEP(a2, u, s); STEP(a3, u, s); STEP(a4, u, s); STEP(a5, u, s);
            STEP(a6, u, s); STEP(a7, u, s); STEP(a8, u, s); STEP(a9, u, s); STEP(a10, u, s); STEP(a11, u, s);
        }
        int acc = OUT(a0) + OUT(a1) + OUT(a2) + OUT(a3) + OUT(a4) + OUT(a5) + OUT(a6) + OUT(a7) + OUT(a8)
                  + OUT(a9) + OUT(a10) + OUT(a11);
        *sink += acc;
    }
    double t = omp_get_wtime() - t0;
    return (double)nthreads * iters * CHAINS * LANES / t;
}
"""


VARIANTS = {"widest": [], "ymm": ["-DPEAK_YMM"], "avx2": ["-DPEAK_AVX2"]}


def build_peak(variant: str) -> tuple[ctypes.CDLL, str]:
    """The peak loop built with gcc -march=native for this variant: (library, instruction kind)."""
    with tempfile.TemporaryDirectory(prefix="int_dot_peak_") as d:
        src, lib = os.path.join(d, "peak.c"), os.path.join(d, "peak.so")
        with open(src, "w") as f:
            f.write(PEAK_C)
        flags = ["-O2", "-march=native", "-fopenmp", "-fPIC", "-shared", *VARIANTS[variant]]
        subprocess.run(["gcc", *flags, src, "-o", lib], check=True)
        so = ctypes.CDLL(lib)  # stays mapped after the file is removed
    so.peak.restype = ctypes.c_double
    so.peak.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int)]
    return so, ctypes.c_char_p.in_dll(so, "kind").value.decode()


def measure_peak(so: ctypes.CDLL, threads: int) -> float:
    sink = ctypes.c_int(0)
    iters = 1 << 16
    while True:  # about 0.3 s per try
        t0 = time.perf_counter()
        so.peak(threads, iters, ctypes.byref(sink))
        if time.perf_counter() - t0 > 0.3:
            break
        iters *= 2
    return max(so.peak(threads, iters, ctypes.byref(sink)) for _ in range(5))


def read_buffer(mb: int) -> torch.Tensor:
    """[mb MiB / 4] float32 ones in huge pages where the OS gives them, as our packed weights are."""
    from specserve.kernels.hostmem import anon_zeros

    return anon_zeros(((mb << 20) // 4,), torch.float32).fill_(1.0)


def read_speed(buf: torch.Tensor) -> float:
    """Bytes per second of one plain read of buf: torch's sum, as weight_stream.py's plain read."""
    t0 = time.perf_counter()
    buf.sum()
    return buf.numel() * 4 / (time.perf_counter() - t0)


def measure_linears(a: argparse.Namespace, peak: float) -> list[dict]:
    from weight_stream import timed

    from specserve.kernels.linear import linear
    from specserve.kernels.tune import random_block_weight

    out = []
    for fmt in a.formats.split(","):
        w = random_block_weight(fmt, a.n, a.k)
        mb = w.nbytes / 1e6
        for m in (int(x) for x in a.rows.split(",")):
            x = torch.randn(m, a.k)  # [M, K]
            t = timed(lambda: linear(x, w), a.rounds)
            macs = m * a.n * a.k / t
            out.append({"format": fmt, "rows": m, "ms": t * 1e3, "weights_mb": mb, "gb_s": mb / 1e3 / t,
                        "gmac_s": macs / 1e9, "share_of_peak": macs / peak})
            print(f"{fmt} M={m}: {t * 1e3:.2f} ms, {mb / 1e3 / t:.1f} GB/s, {macs / 1e9:.0f} GMAC/s "
                  f"({100 * macs / peak:.0f}% of peak)", file=sys.stderr, flush=True)
    return out


def kv_bytes(cfg, keys: int) -> int:
    """Bytes of fp32 K and V one row's attention reads over ``keys`` cached keys, all layers (a
    sliding layer reads at most its window)."""
    from specserve.engine.config import kv_bytes_per_token

    per_layer = kv_bytes_per_token(cfg, "fp32", num_layers=1)
    return per_layer * sum(min(keys, cfg.sliding_window) if cfg.sliding(i) else keys for i in cfg.attention_layers)


def measure_models(a: argparse.Namespace, peak: float, buf: torch.Tensor) -> list[dict]:
    """Each model's one-row and 8-row forwards (decode_cost.py's verify shape at --context) against
    two floors: its linears' weight bytes and its fp32 K/V at --context, at the read speed of buf
    measured in the same rounds (one plain read per round: this machine's memory speed moves from
    minute to minute); and the linears' multiply-adds (8 per weight at 8 rows) at the int8 peak."""
    import decode_cost as dc

    from specserve.models.layers import linears
    from specserve.models.loader import LoadOptions, load_model

    out = []
    for name in a.models.split(","):
        lm = load_model(name, LoadOptions("cpu", "auto", "auto"))
        ws = [lin.weight for lin in linears(lm.model)]
        macs = sum(w.shape[0] * w.shape[1] for w in ws)  # per row
        wbytes = sum(w.nbytes for w in ws)
        kbytes = kv_bytes(lm.config, a.context)
        nbytes = wbytes + kbytes  # what a one-row forward must read
        bps = -(-(a.context + 8) // dc.BLOCK)
        kv = dc.filled_cache(lm.config, bps, "fp32")
        batches = {m: dc.make_batch(m, a.context, "verify", bps, lm.config.vocab_size) for m in (1, 8)}
        ts = {1: [], 8: [], "read": []}
        with torch.inference_mode():
            for r in range(a.rounds + 2):
                for m in ((1, 8) if r % 2 else (8, 1)):
                    t = dc.timed_forward(lm.model, batches[m], kv, None)
                    if r >= 2:
                        ts[m].append(t)
                bw = read_speed(buf)
                if r >= 2:
                    ts["read"].append(bw)
        t1, t8, read = (statistics.median(ts[k]) for k in (1, 8, "read"))
        mem, comp = nbytes / read, 8 * macs / peak
        out.append({"model": name, "weights_mb": wbytes / 1e6, "kv_mb": kbytes / 1e6, "gmacs_per_row": macs / 1e9,
                    "ms_1": t1 * 1e3, "ms_8": t8 * 1e3, "read_gb_s": read / 1e9, "read_floor_ms": mem * 1e3,
                    "compute_floor_8_ms": comp * 1e3, "gb_s_1": nbytes / t1 / 1e9,
                    "t1_over_floor": t1 / mem, "t8_over_floor": t8 / max(mem, comp)})
        print(f"{name}: {out[-1]}", file=sys.stderr, flush=True)
        del lm, kv, batches
    return out


def markdown(peaks: list[dict], read: float, rows: list[dict], models: list[dict],
             a: argparse.Namespace) -> str:
    lines = [f"int8 dot-product peak, {a.threads} threads (operands in registers, best of 5):", "",
             "| instruction | GMAC/s |", "|---|---|"]
    lines += [f"| {p['kind']} | {p['gmac_s']:.0f} |" for p in peaks]
    lines += ["", f"Memory read (torch sum), {a.threads} threads, {a.read_mb} MB (best of 5): {read:.1f} GB/s"]
    if rows:
        lines += ["", f"Our integer-dot linears, {a.n} x {a.k} (median ms; share of the first peak above):", "",
                  "| format | MB | M | ms | GB/s | GMAC/s | share of peak |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['format']} | {r['weights_mb']:.0f} | {r['rows']} | {r['ms']:.2f} | {r['gb_s']:.1f} | "
                  f"{r['gmac_s']:.0f} | {100 * r['share_of_peak']:.0f}% |" for r in rows]
    if models:
        lines += ["", f"Forwards at a {a.context}-token context against their floors (median ms; the read speed "
                  f"measured in the same rounds, one torch sum over {a.read_mb} MB each; read floor: the linears' weight "
                  "bytes and the fp32 K/V at that speed; compute floor: the linears' int8 multiply-adds at the first "
                  "peak):", "",
                  "| model | linears MB | K/V MB | GMAC per row | read GB/s | 1 row | read floor | t(1) / floor | 8 rows | "
                  "compute floor, 8 rows | t(8) / larger floor | t(8)/t(1) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['weights_mb']:.0f} | {r['kv_mb']:.1f} | {r['gmacs_per_row']:.3f} | "
                  f"{r['read_gb_s']:.1f} | "
                  f"{r['ms_1']:.1f} | {r['read_floor_ms']:.1f} | {r['t1_over_floor']:.2f} | {r['ms_8']:.1f} | "
                  f"{r['compute_floor_8_ms']:.1f} | {r['t8_over_floor']:.2f} | {r['ms_8'] / r['ms_1']:.2f} |"
                  for r in models]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--formats", default="Q4_K,Q6_K,Q8_0,Q4_1")
    ap.add_argument("--n", type=int, default=131072, help="output channels of the timed linears")
    ap.add_argument("--k", type=int, default=1536, help="input channels (a multiple of 256)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--read-mb", type=int, default=1024, help="buffer size of the memory read test")
    ap.add_argument("--models", default="", help="catalog models whose forwards to set against the floors")
    ap.add_argument("--context", type=int, default=512, help="cached tokens before the rows of --models")
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    from specserve.kernels.tune import cpu_flags

    peaks = []
    for v in ["widest", "ymm", "avx2"] if "avx2" in cpu_flags() else ["widest"]:
        so, kind = build_peak(v)
        if any(p["kind"] == kind for p in peaks):  # this CPU has nothing narrower of that kind
            continue
        peaks.append({"kind": kind, "gmac_s": measure_peak(so, a.threads) / 1e9})
        print(f"peak {kind}: {peaks[-1]['gmac_s']:.0f} GMAC/s", file=sys.stderr, flush=True)
    buf = read_buffer(a.read_mb)
    read_speed(buf)  # faults the buffer in
    read = max(read_speed(buf) for _ in range(5)) / 1e9
    print(f"read {a.read_mb} MB: {read:.1f} GB/s", file=sys.stderr, flush=True)
    rows = measure_linears(a, peaks[0]["gmac_s"] * 1e9) if a.formats else []
    models = measure_models(a, peaks[0]["gmac_s"] * 1e9, buf) if a.models else []
    md = markdown(peaks, read, rows, models, a)
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "peaks": peaks, "read_gb_s": read, "linears": rows,
                       "models": models}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
