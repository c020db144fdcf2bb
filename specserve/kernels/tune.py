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

The weight streams' software prefetch hint (``prefetcht1`` by default, or ``prefetcht0``; attention's
prefetch of the KV cache's rows follows the same switch) is chosen
per engine instead, over its model's first real forwards (``HintTrial``): the hint changes forward by
forward, neighbours of the same width form pairs, and the median ratio of the pairs decides. t0 was
~10% faster on Zen 5 and a third slower on Zen 4; timing random matrices did not tell them apart
reliably (parts of them stay in cache), and timing the model's own forward at start-up saw no
difference in about half the starts, whose first forwards all ran slow.
``SPECSERVE_PREFETCH_HINT`` (``t0``, ``t1``) skips the trial.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from . import build as _build

logger = logging.getLogger(__name__)

ENV = "SPECSERVE_KERNEL_VARIANT"
HINT_ENV = "SPECSERVE_PREFETCH_HINT"
TRIAL_SKIP = 8  # an engine's first forwards, left out of its hint trial (pages, caches)
TRIAL_PAIRS = 16  # pairs of forwards the trial's choice takes
TRIAL_ROWS = 4  # forwards of up to this many rows count (wider ones are bound by arithmetic, not the stream)
TRIAL_GIVE_UP = 400  # forwards after which a trial short of pairs keeps the default hint
# t0 must beat t1 by this much in the median pair: smaller than the builds' MARGIN, because a pair's
# forwards run a moment apart (five trials on Zen 5 measured 0.975-0.987, results_final/zen5_1206b),
# and where the two hints are nearly equal either choice costs nothing
HINT_MARGIN = 0.01
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


class HintTrial:
    """Chooses the prefetch hint over an engine's first real forwards. After ``skip`` forwards the hint
    changes forward by forward; two neighbours of the same width (at most TRIAL_ROWS rows), one under
    each hint, form a pair, and the next pair starts with the hint the last one ended with (t1, t0 |
    t0, t1 | ...), so neither hint always runs second. After ``pairs`` pairs: t0 if the median ratio
    t0 / t1 is under 1 - HINT_MARGIN, else t1; after ``give_up`` forwards short of pairs (a server that
    only prefills, or only verifies wide), t1. A pair's two forwards run a moment apart, so a machine
    whose speed drifts (the first forwards of a new model, a neighbour's load) moves both alike.
    The engine calls ``before`` ahead of each timed forward and ``after`` with its rows and
    seconds; ``after`` returns the record once, when the choice is made."""

    def __init__(self, set_t0: Callable[[bool], object], pairs: int = TRIAL_PAIRS, skip: int = TRIAL_SKIP,
                 give_up: int = TRIAL_GIVE_UP):
        self.set_t0, self.pairs, self.skip, self.give_up = set_t0, pairs, skip, give_up
        self.ratios: list[float] = []  # t0 / t1 of each pair
        self.seen, self.t0, self.last = 0, False, None  # last: (rows, t0, seconds) of an open pair
        self.choice: str | None = None
        set_t0(False)

    @classmethod
    def begin(cls, set_t0: Callable[[bool], object]) -> tuple[HintTrial | None, dict | None]:
        """(a trial, None), or (None, the record) where SPECSERVE_PREFETCH_HINT forces the hint."""
        forced = _forced(HINT_ENV, ("t0", "t1"))
        if forced:
            set_t0(forced == "t0")
            return None, {"prefetch": forced, "source": HINT_ENV}
        return cls(set_t0), None

    def before(self) -> None:
        """Set the hint the engine's next forward runs with: the trial's turn, then the choice. The
        hint is process-global (the C library's), so it is set before every forward: in a process
        with several engines each forward runs under its own engine's hint."""
        if self.choice is not None:
            self.set_t0(self.choice == "t0")
        else:
            self.set_t0(self.seen >= self.skip and self.t0)

    def after(self, rows: int, seconds: float) -> dict | None:
        if self.choice is not None:
            return None
        self.seen += 1
        if self.seen <= self.skip:
            return None
        hint, self.t0 = self.t0, not self.t0
        if rows > TRIAL_ROWS or self.last is None or self.last[0] != rows:
            self.last = (rows, hint, seconds) if rows <= TRIAL_ROWS else None
        else:
            t0s, t1s = (seconds, self.last[2]) if hint else (self.last[2], seconds)
            self.ratios.append(t0s / t1s)
            self.last, self.t0 = None, hint  # the next pair starts where this one ended
        if len(self.ratios) < self.pairs and self.seen < self.skip + self.give_up:
            return None
        return self._decide()

    def _decide(self) -> dict:
        ratio = statistics.median(self.ratios) if self.ratios else None
        self.choice = "t0" if len(self.ratios) >= self.pairs and ratio < 1.0 - HINT_MARGIN else "t1"
        self.set_t0(self.choice == "t0")
        return {"prefetch": self.choice, "source": "measured", "pairs": len(self.ratios),
                "t0_over_t1": None if ratio is None else round(ratio, 4)}


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
