"""The Gated DeltaNet kernel's one-row step at Qwen3.5-35B-A3B's shapes (16 key / 32 value heads of
128; a 2 MB state read and a 2 MB state written a layer), with the state written by streaming stores
(this build) against plain stores (-DDN_STREAM=0), the two builds taking turns in one process: 16
layers' states cycled so each call finds its state out of cache, as in a model's step. Also checks
that both builds give the same bits.

    python results_final/zen4_1207e/deltanet_store.py > results_final/zen4_1207e/deltanet_store.txt
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

    libs = {"streaming stores": library.build_with_flags(""), "plain stores": library.build_with_flags("-DDN_STREAM=0")}
    outs = {}
    for label, lib in libs.items():
        with library.using(lib):
            outs[label] = (run(), [p[3].clone() for p in planes])
    a_out, b_out = outs.values()
    same = all(torch.equal(x, y) for x, y in zip(a_out[0] + a_out[1], b_out[0] + b_out[1]))
    times = {label: [] for label in libs}
    for r in range(20):
        for label in (list(libs) if r % 2 else list(libs)[::-1]):
            with library.using(libs[label]):
                t = time.perf_counter()
                run()
                times[label].append((time.perf_counter() - t) / LAYERS * 1e3)
    print(f"same outputs and states in both builds: {same}")
    for label, ts in times.items():
        print(f"{label}: {statistics.median(ts):.3f} ms a layer (median of 20 rounds of {LAYERS} layers; "
              f"min {min(ts):.3f})")


if __name__ == "__main__":
    main()
