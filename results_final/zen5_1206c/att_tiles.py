"""Paged attention alone over an fp32 cache: tiles of ATT_F32_TILE_BYTES (the build as committed) against
one tile per work item (the kernels before, -DATT_F32_TILE_BYTES=1 GiB), builds taking turns in one
process, at the shapes of qwen2.5-coder-1.5b (12 query heads, 2 kv heads, head dim 128, 28 layers)
and smollm2-135m (9 / 3 / 64, 30 layers), one sequence of `ctx` cached keys and M new rows (the
verify shape), median of 25 rounds of all layers; every round's outputs are checked equal (tiles
move no bits).

    python results_final/zen5_1206c/att_tiles.py > results_final/zen5_1206c/att_tiles.txt

With an argument "label=cflags;label=cflags;..." the same comparison of other builds (the first is
the one the ratios are to), e.g. att_prefetch.txt (run.sh).
"""
import os
import statistics as st
import sys
import time

import torch

if __name__ == "__main__":  # (imported, the caller's specserve: att_experiments.py runs a patched copy)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from specserve.kernels import library  # noqa: E402
from specserve.kernels.attention import paged_attention  # noqa: E402

SHAPES = {"qwen2.5-coder-1.5b": (12, 2, 128, 28), "smollm2-135m": (9, 3, 64, 30)}  # Hq, Hkv, D, layers


def case(Hq, Hkv, D, ctx, M, layers, BS=16):
    g = torch.Generator().manual_seed(0)
    NB = (ctx + M) // BS + 2
    ks = [torch.randn(NB, BS, Hkv, D, generator=g) for _ in range(layers)]
    vs = [torch.randn(NB, BS, Hkv, D, generator=g) for _ in range(layers)]
    bt = torch.randperm(NB, generator=g).to(torch.int32)[None]
    q = torch.randn(M, Hq, D, generator=g)
    return ks, vs, bt, q, torch.zeros(M, dtype=torch.int32), torch.arange(ctx, ctx + M, dtype=torch.int32)


def layers_once(c, D):
    ks, vs, bt, q, seq, pos = c
    t0 = time.perf_counter()
    outs = [paged_attention(q, k, v, bt, seq, pos, D ** -0.5) for k, v in zip(ks, vs)]
    return time.perf_counter() - t0, outs


def builds(spec: str) -> dict:
    """"label=cflags;label=cflags;..." -> label -> the library built so"""
    return {label: library.build_with_flags(flags) for label, flags in (b.split("=", 1) for b in spec.split(";"))}


def compare(libs: dict, cases, rounds: int = 25, gbps: bool = False) -> None:
    """For each (model, ctx, M) of cases: every build's median time over the rounds (builds taking turns,
    outputs checked equal), its ratio to the first build's and with gbps the K / V bytes read per second."""
    for name, ctx, M in cases:
        Hq, Hkv, D, layers = SHAPES[name]
        c = case(Hq, Hkv, D, ctx, M, layers)
        ts = {k: [] for k in libs}
        for r in range(rounds):
            ref = None
            for label, lib in libs.items():
                with library.using(lib):
                    t, outs = layers_once(c, D)
                ts[label].append(t)
                assert ref is None or all(torch.equal(a, b) for a, b in zip(ref, outs))
                ref = outs
        base = st.median(ts[next(iter(libs))])
        gb = 2 * ctx * Hkv * D * 4 * layers / 1e9
        print(f"{name} ctx {ctx} M {M}: " + ", ".join(
            f"{k} {st.median(v) * 1e3:.2f} ({st.median(v) / base:.2f}" + (f", {gb / st.median(v):.0f} GB/s" if gbps else "")
            + ")" for k, v in ts.items()), flush=True)


if __name__ == "__main__":
    print("ms for all layers (median of 25), ratio to the first build")
    compare(builds(sys.argv[1] if len(sys.argv) > 1 else "one tile=-DATT_F32_TILE_BYTES=1073741824;tiles="),
            [(name, ctx, M) for name in SHAPES for ctx in (512, 2048, 8192) for M in (1, 4, 8)
             if not (ctx == 8192 and name == "smollm2-135m")])
