"""The Gated DeltaNet kernel's one-row step at Qwen3.5-35B-A3B's shapes (16 key / 32 value heads of
128; a 2 MB state read and a 2 MB state written a layer): this build against builds without one of
its changes, taking turns in one process: the state written by plain stores (-DDN_STREAM=0, as
before 514faeb), and a row's conv + SiLU on one thread (-DDN_CONV_CHANNELS=2^30, as before the
commit after 514faeb that split it in pieces of channels). 16 layers' states cycled so each call
finds its state out of cache, as in a model's step. Also checks that every build gives the same bits.

    python results_final/zen4_1207e/deltanet_ab.py > results_final/zen4_1207e/deltanet_ab.txt
(deltanet_store_run1.txt: an earlier form of this script with the first two builds only.)
"""

import statistics
import time

import torch

from specserve.kernels import library, ops

HK, HV, DK, DV, K = 16, 32, 128, 128, 4
C = 2 * HK * DK + HV * DV
LAYERS = 16


def main() -> None:
    g = torch.Generator().manual_seed(0)
    qkv, a, b = torch.randn(1, C, generator=g), torch.randn(1, HV, generator=g), torch.randn(1, HV, generator=g)
    conv, A, dt = torch.randn(K, C, generator=g) * 0.3, -torch.rand(HV, generator=g) - 0.5, torch.randn(HV, generator=g)
    planes = [(torch.randn(K - 1, C, generator=g), torch.randn(HV, DK, DV, generator=g) * 0.1, torch.empty(K - 1, C),
               torch.empty(HV, DK, DV)) for _ in range(LAYERS)]

    def run():
        return [ops.gated_delta(qkv, a, b, conv, A, dt, (HK, HV, DK, DV), ci, si, [co], [so])
                for ci, si, co, so in planes]

    libs = {"this build": library.build_with_flags(""), "plain stores": library.build_with_flags("-DDN_STREAM=0"),
            "conv on one thread": library.build_with_flags(f"-DDN_CONV_CHANNELS={1 << 30}")}
    outs = {}
    for label, lib in libs.items():
        with library.using(lib):
            out = run()
            outs[label] = out + [p[3].clone() for p in planes]
    first = next(iter(outs.values()))
    same = all(torch.equal(x, y) for o in outs.values() for x, y in zip(first, o))
    times = {label: [] for label in libs}
    for r in range(20):
        for label in (list(libs) if r % 2 else list(libs)[::-1]):  # turns, the order alternating
            with library.using(libs[label]):
                t = time.perf_counter()
                run()
                times[label].append((time.perf_counter() - t) / LAYERS * 1e3)
    print(f"same outputs and states in every build: {same}")
    for label, ts in times.items():
        print(f"{label}: {statistics.median(ts):.3f} ms a layer (median of 20 rounds of {LAYERS} layers; "
              f"min {min(ts):.3f})")


if __name__ == "__main__":
    main()
