"""One-row attention over an fp32 cache at the 1.5b's shapes (att_tiles.py's case), builds with the KV rows prefetched
8, 16, 32 (the default) or 64 keys ahead, and with prefetcht0, taking turns in one process (2026-12-07, Zen 5).

    python results_final/zen5_1207/att_pf.py "base=;pf16=-DATT_PF=16;pf64=-DATT_PF=64;pf8=-DATT_PF=8;t0=-DATT_PF_HINT=3"
"""
import os, statistics as st, sys, time
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
from specserve.kernels import library
from specserve.kernels.attention import paged_attention
SPEC = sys.argv[1]
BUILDS = {label: library.build_with_flags(flags) for label, flags in (b.split("=", 1) for b in SPEC.split(";"))}
src = open(os.path.join(ROOT, "results_final", "zen5_1206c", "att_tiles.py")).read()
ns = {}
exec("import torch\ndef case" + src.split("def case")[1].split("def layers_once")[0], ns)
case = ns["case"]
def layers_once(c, D):
    ks, vs, bt, q, seq, pos = c
    t0 = time.perf_counter()
    outs = [paged_attention(q, k, v, bt, seq, pos, D ** -0.5) for k, v in zip(ks, vs)]
    return time.perf_counter() - t0, outs
for name, (Hq, Hkv, D, layers) in {"qwen2.5-coder-1.5b": (12, 2, 128, 28)}.items():
    for ctx, M in ((2048, 1), (8192, 1), (2048, 8)):
        c = case(Hq, Hkv, D, ctx, M, layers)
        ts = {k: [] for k in BUILDS}
        for r in range(21):
            for label, lib in BUILDS.items():
                with library.using(lib):
                    t, outs = layers_once(c, D)
                ts[label].append(t)
        base = st.median(ts[next(iter(BUILDS))])
        gb = 2 * ctx * Hkv * D * 4 * layers / 1e9
        print(f"{name} ctx {ctx} M {M}: " + ", ".join(f"{k} {st.median(v)*1e3:.2f} ({st.median(v)/base:.2f}, {gb/st.median(v):.0f} GB/s)" for k, v in ts.items()), flush=True)
