"""The Gated DeltaNet kernel's conv SiLU with the kernels' vector exp (this build: exp_avx2 and its
scalar mirror, as act_mul's silu) against libm's expf one value at a time (-DDN_SILU_LIBM=1, as
before), taking turns in one process: the kernel alone at Qwen3.5-0.8B's shapes (16 / 16 heads of
128, 6144 conv channels), one row and four (a verification of 3 drafts, every row's state written),
18 layers' states cycled; then the 0.8B-shaped model's decode step (hybrid_speed.py's Q4_K_M file,
fused layers) under each build. The two builds differ in the last bits of the SiLU (tests check the
model against transformers and every build against the others).

    python results_final/zen4_1208/deltanet_silu_ab.py > results_final/zen4_1208/deltanet_silu_ab.txt
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zen4_1207e"))

from specserve.kernels import library, ops  # noqa: E402
from specserve.models.catalog import cache_root  # noqa: E402

from moe_model import decoding_engine  # noqa: E402

HK, HV, D, K, LAYERS = 16, 16, 128, 4, 18
C = 2 * HK * D + HV * D
GGUF = cache_root() / "bench" / "qwen35-0.8b-random" / "qwen35-0.8b-random-q4_k_m.gguf"


def kernel(n: int):
    g = torch.Generator().manual_seed(n)
    qkv, a, b = torch.randn(n, C, generator=g), torch.randn(n, HV, generator=g), torch.randn(n, HV, generator=g)
    conv, A, dt = torch.randn(K, C, generator=g) * 0.3, -torch.rand(HV, generator=g) - 0.5, torch.randn(HV, generator=g)
    planes = [(torch.randn(K - 1, C, generator=g), torch.randn(HV, D, D, generator=g) * 0.1,
               [torch.empty(K - 1, C) for _ in range(n)], [torch.empty(HV, D, D) for _ in range(n)])
              for _ in range(LAYERS)]
    return lambda: [ops.gated_delta(qkv, a, b, conv, A, dt, (HK, HV, D, D), ci, si, co, so) for ci, si, co, so in planes]


def turns(libs: dict, fn, rounds: int) -> dict:
    times = {label: [] for label in libs}
    for r in range(rounds):
        for label in (list(libs) if r % 2 else list(libs)[::-1]):
            with library.using(libs[label]):
                t = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t)
    return times


def main() -> None:
    libs = {"vector exp": library.build_with_flags(""), "libm expf": library.build_with_flags("-DDN_SILU_LIBM=1")}
    for n in (1, 4):
        print(f"kernel, {n} row(s), ms a layer (median of 30 rounds of {LAYERS} layers):")
        for label, ts in turns(libs, kernel(n), 30).items():
            print(f"  {label}: {statistics.median(ts) / LAYERS * 1e3:.3f}")
    _, eng = decoding_engine(max_model_len=1024, max_tokens=900, path=GGUF)
    print("0.8B-shaped model, decode step (fused layers), ms, 8 turns of 20 steps each:")
    for label, ts in turns(libs, lambda: [eng.step() for _ in range(20)], 16).items():
        print(f"  {label}: median {statistics.median(ts) / 20 * 1e3:.2f} (" + " ".join(f"{t / 20 * 1e3:.2f}" for t in ts)
              + ")")


if __name__ == "__main__":
    main()
