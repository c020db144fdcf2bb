"""Attention experiments not kept (2026-12-06, AMD EPYC Zen 5): builds of a patched copy of the kernels
(att_experiments.patch, run by att_experiments.sh) taking turns in one process, median of 25 rounds of
all layers of paged attention at qwen2.5-coder-1.5b's shape (12 / 2 heads, head dim 128, 28 layers) and
smollm2-135m's (9 / 3, 64, 30 layers), one sequence of `ctx` keys and M new rows, block ids shuffled.
  head-major: K / V pools [blocks, kv heads, block size, dim] instead of [blocks, block size, kv heads,
              dim] (each kv head's rows of a block contiguous; the same values permuted, same bits)
  V prefetch: while the scores read K's rows, prefetch V's rows of the same keys (into L2)
  8 rows an item: up to 8 rows of a sequence per work item instead of 4 (ATT_QT)
  prefetch 64 t0: the cache rows prefetched 64 keys ahead with prefetcht0 (32 with prefetcht1)
  no prefetch: no software prefetch of the cache rows
Then one row at 2048 keys, the 1.5b's shape: all 28 layers (each layer's K / V from memory) against
one layer called 28 times (its 4 MB of K / V in cache), with the base build.
"""
import statistics as st

import torch

from specserve.kernels import library
from att_tiles import layers_once as run  # (this script's directory; the specserve imported above: the patched copy)

BUILDS = {"base": "", "head-major": "-DKV_HEAD_MAJOR", "V prefetch": "-DATT_VPF=2", "8 rows an item": "-DATT_QT=8",
          "prefetch 64 t0": "-DATT_PF=64 -DATT_PF_HINT=3", "no prefetch": "-DATT_NOPF=1"}
LIBS = {k: library.build_with_flags(v) for k, v in BUILDS.items()}


def case(Hq, Hkv, D, ctx, M, layers, BS=16):
    g = torch.Generator().manual_seed(0)
    NB = (ctx + M) // BS + 2
    ks = [torch.randn(NB, BS, Hkv, D, generator=g) for _ in range(layers)]
    vs = [torch.randn(NB, BS, Hkv, D, generator=g) for _ in range(layers)]
    # head-major pools: the same values permuted, handed over as views of the shape the checks expect
    hm = [[t.permute(0, 2, 1, 3).contiguous().view(NB, BS, Hkv, D) for t in ts] for ts in (ks, vs)]
    bt = torch.randperm(NB, generator=g).to(torch.int32)[None]
    rest = (bt, torch.randn(M, Hq, D, generator=g), torch.zeros(M, dtype=torch.int32),
            torch.arange(ctx, ctx + M, dtype=torch.int32))
    return (ks, vs, *rest), (*hm, *rest)


print("ms for all layers (median of 25); ratio to base")
for name, (Hq, Hkv, D, layers) in {"qwen2.5-coder-1.5b": (12, 2, 128, 28), "smollm2-135m": (9, 3, 64, 30)}.items():
    for ctx in (512, 2048):
        for M in (1, 4, 8):
            plain, hm = case(Hq, Hkv, D, ctx, M, layers)
            ts = {k: [] for k in LIBS}
            for r in range(25):
                ref = None
                for label, lib in LIBS.items():
                    with library.using(lib):
                        t, outs = run(hm if label == "head-major" else plain, D)
                    ts[label].append(t)
                    assert ref is None or all(torch.equal(a, b) for a, b in zip(ref, outs)), label
                    ref = outs
            base = st.median(ts["base"])
            print(f"{name} ctx {ctx} M {M}: " + ", ".join(
                f"{k} {st.median(v) * 1e3:.2f} ({st.median(v) / base:.2f})" for k, v in ts.items()), flush=True)

plain, _ = case(12, 2, 128, 2048, 1, 28)
ks, vs, *rest = plain
cached = ([ks[0]] * 28, [vs[0]] * 28, *rest)
ts = {"28 layers": [], "one layer x 28": []}
with library.using(LIBS["base"]):
    for r in range(25):
        ts["28 layers"].append(run(plain, 128)[0])
        ts["one layer x 28"].append(run(cached, 128)[0])
print("qwen2.5-coder-1.5b ctx 2048 M 1, base: " + ", ".join(
    f"{k} {st.median(v) * 1e3:.2f} ms ({st.median(v) / 28 * 1e6:.0f} us a layer)" for k, v in ts.items()))
