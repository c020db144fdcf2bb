"""Which build of the C kernels runs fastest on this CPU: measured once, then remembered.

``-march=native`` is not always the fastest build. Zen 4 runs AVX-512 as two 256-bit halves,
where the same loops compiled for 256-bit vectors can win; Zen 5 and Intel run it full width.
So on a CPU with AVX-512 two builds of the same source compete: ``native`` and ``native256``
(``-march=native -mno-avx512f``: AVX2, plus AVX-VNNI where the CPU has it). Every build computes
the same bits (the kernel tests compare them), so the choice changes speed, never output.

The contest times decode-shaped work with each build, interleaved, best of several rounds:
integer-dot linears over Q4_K, Q6_K and int8 weights at 1 and 8 rows, and paged attention of 8
rows over 512 keys. The winner is written to ``tune-<key>.json`` beside the built libraries (the
key covers the sources, compiler and CPU, like the libraries' own), so a CPU is measured once;
concurrent processes (tensor-parallel ranks) wait on a file lock and read the same answer.

``SPECSERVE_KERNEL_VARIANT`` (``native``, ``native256``, ``avx2``) skips the contest.

The weight streams' software prefetch hint (``prefetcht1`` by default, or ``prefetcht0``) is chosen
per loaded model instead (``choose_prefetch``, called by the engine at start-up): its own one-row
forward, timed both ways. t0 was ~10% faster on Zen 5 and a third slower on Zen 4, and timing
random matrices did not tell them apart reliably (parts of them stay in cache).
``SPECSERVE_PREFETCH_HINT`` (``t0``, ``t1``) skips the timing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from . import build as _build

logger = logging.getLogger(__name__)

ENV = "SPECSERVE_KERNEL_VARIANT"
HINT_ENV = "SPECSERVE_PREFETCH_HINT"
HINT_ROUNDS = 8
HINT_WARM_UP = 4  # forwards before the timing: a new model's first ones run slower (pages, caches)
CHOOSABLE = ("native", "native256", "avx2")
ROUNDS = 15
# a challenger must beat native by this much: nearly equal times are noise, and native is the
# build the tests exercise most
MARGIN = 0.03


class BadVariant(ValueError):
    pass


def contenders(cpu_flags: set[str]) -> list[str]:
    """The builds worth timing on a CPU with these /proc/cpuinfo flags."""
    return ["native", "native256"] if "avx512f" in cpu_flags else ["native"]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick(times: dict[str, float]) -> str:
    """The fastest build; native unless another is faster by more than MARGIN."""
    best = min(times, key=times.__getitem__)
    if "native" in times and times[best] > times["native"] * (1.0 - MARGIN):
        return "native"
    return best


def random_block_weight(qtype: str, n: int, k: int, g=None):
    """A GGUFBlockWeight [n, k] of random Q4_K, Q6_K, Q8_0, Q4_0 or Q4_1 blocks with finite fp16
    scales (about 0.01: random bytes could be NaN / inf), for timing."""
    import torch

    from .library import GGUF_QTYPES
    from .linear import GGUFBlockWeight

    _, qk, bb = GGUF_QTYPES[qtype]  # values and bytes per block
    scale_at = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2)}[qtype]  # fp16 scales
    raw = torch.randint(0, 256, (n, k // qk, bb), dtype=torch.uint8, generator=g)
    for o in scale_at:
        raw[:, :, o], raw[:, :, o + 1] = 0x1F, 0x21
    return GGUFBlockWeight(raw.reshape(n, -1).contiguous(), qtype, n, k)


def _workload(impl: str) -> Callable[[], None]:
    """One decode-shaped pass over the hot kernels with the build ``impl`` (c-<variant>)."""
    import torch

    from .attention import paged_attention
    from .linear import Int8Weight, linear

    g = torch.Generator().manual_seed(0)
    weights = [Int8Weight.from_float(torch.randn(1024, 2048, generator=g))]
    weights += [random_block_weight(qtype, 1024, 2048, g) for qtype in ("Q4_K", "Q6_K")]
    xs = [torch.randn(m, 2048, generator=g) for m in (1, 8)]
    bs, blocks, hkv, hq, d = 16, 33, 2, 12, 64
    kc = torch.randn(blocks, bs, hkv, d, generator=g)
    vc = torch.randn(blocks, bs, hkv, d, generator=g)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    q = torch.randn(8, hq, d, generator=g)
    seq = torch.zeros(8, dtype=torch.int32)
    pos = torch.arange(504, 512, dtype=torch.int32)

    def run() -> None:
        for w in weights:
            for x in xs:
                linear(x, w, impl=impl)
        paged_attention(q, kc, vc, table, seq, pos, 0.125, impl=impl)

    return run


def measure(variants: list[str], rounds: int = ROUNDS) -> dict[str, float]:
    """Best-of-rounds seconds of the workload per build, the builds taking turns."""
    runs = {v: _workload(f"c-{v}") for v in variants}
    for run in runs.values():
        run()  # warm up: page in, spin up the threads
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for v, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[v] = min(best[v], time.perf_counter() - t0)
    return best


def _forced(var: str, choices: tuple[str, ...]) -> str | None:
    """The choice environment variable ``var`` forces (None: unset or auto); BadVariant if unknown."""
    forced = os.environ.get(var, "").strip().lower()
    if not forced or forced == "auto":
        return None
    if forced not in choices:
        raise BadVariant(f"{var}={forced!r}: expected one of auto, {', '.join(choices)}")
    return forced


def choose_prefetch(run: Callable[[], None], set_t0: Callable[[bool], object], rounds: int = HINT_ROUNDS,
                    clock: Callable[[], float] = time.perf_counter) -> dict:
    """{"prefetch": "t0" | "t1", "times", "source"}: the hint under which ``run`` (a model's one-row
    forward) is fastest, best of ``rounds`` taking turns after HINT_WARM_UP runs; t1 unless t0 wins by more
    than MARGIN. Leaves the chosen hint set."""
    forced = _forced(HINT_ENV, ("t0", "t1"))
    if forced:
        set_t0(forced == "t0")
        return {"prefetch": forced, "times": {}, "source": HINT_ENV}
    best = {"t1": float("inf"), "t0": float("inf")}
    for _ in range(HINT_WARM_UP):
        run()
    for _ in range(rounds):
        for hint in best:
            set_t0(hint == "t0")
            t0 = clock()
            run()
            best[hint] = min(best[hint], clock() - t0)
    hint = "t0" if best["t0"] < best["t1"] * (1.0 - MARGIN) else "t1"
    set_t0(hint == "t0")
    return {"prefetch": hint, "times": {h: round(t * 1e3, 3) for h, t in best.items()}, "source": "measured"}


def _record_path() -> Path | None:
    res = _build.get_build("native")
    return Path(res.path).with_name(f"tune-{Path(res.path).stem.rsplit('-', 1)[-1]}.json") if res.path else None


def _read(path: Path) -> dict | None:
    try:
        rec = json.loads(path.read_text())
        return rec if rec.get("variant") in CHOOSABLE else None
    except (OSError, ValueError):
        return None


def choose() -> dict:
    """{"variant", "times", "source"}: the build to use, how it was chosen."""
    forced = _forced(ENV, CHOOSABLE)
    if forced:
        return {"variant": forced, "times": {}, "source": ENV}
    path = _record_path()
    if path is None:  # no native build: the library loader reports why
        return {"variant": "native", "times": {}, "source": "default"}
    rec = _read(path)
    if rec is not None:
        return {**rec, "source": str(path)}
    with _build.FileLock(path.with_suffix(".lock")):
        rec = _read(path)  # another process measured meanwhile
        if rec is not None:
            return {**rec, "source": str(path)}
        variants = [v for v in contenders(cpu_flags()) if _build.get_build(v).lib is not None]
        times = measure(variants) if len(variants) > 1 else {"native": 0.0}
        rec = {"variant": pick(times), "times": {v: round(t * 1e3, 3) for v, t in times.items()}}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, path)
        logger.info("C kernel build chosen by measurement: %s (ms per pass: %s)", rec["variant"], rec["times"])
        return {**rec, "source": "measured"}
