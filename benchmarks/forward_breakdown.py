"""Where one forward spends its time, per kernel, for 1 row and for M rows (a verification).

    python benchmarks/forward_breakdown.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--rows 1,8]
        [--context 512] [--rounds 20] [--path python|fused] [--markdown breakdown.md] [--out breakdown.json]

--path python (the default): the model runs its per-op Python path (``Transformer.fused = False``:
the same kernels as the fused C path, one call each), with every kernel entry point wrapped by a
timer: the linear layers by role (qkv, o, gate|up, down, lm_head), paged attention, the norms,
rope, act_mul, and the rest of the forward (embedding lookup, Python, tensor glue) as "other". The
per-op path pays a few ms of Python overhead per forward that the default fused path does not
(README "Forward cost"), which lands in "other".
--path fused: the default fused path (all decoder layers in one C call), timed by the C library's
own stage timers (``ss_decoder_profile``: norm, qkv, rope + kv write, attention, o, residual,
gate|up, act_mul, down, summed over the layers); "outside the layers" is the rest of the forward
(embedding, final norm, LM head, Python).
The row counts are interleaved round by round and each cell is the median over the rounds, in ms
per forward; the last column is the cell at the largest M over the cell at the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from decode_cost import BLOCK, filled_cache, make_batch  # noqa: E402
from specserve.engine.builder import set_threads  # noqa: E402
from specserve.kernels import library, ops  # noqa: E402
from specserve.models.layers import Linear  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402

KERNELS = ("linear", "paged_attention", "rms_norm", "rope", "act_mul")


class Timers:
    """Wraps the ops entry points; ``acc`` collects seconds per label during one forward."""

    def __init__(self, model):
        self.acc: dict[str, float] = defaultdict(float)
        self.roles: dict[int, str] = {}
        for layer in model.layers:
            for name, lin in layer.named_modules():
                if isinstance(lin, Linear):
                    name = name.rpartition(".")[2]
                    self.roles[id(lin.weight)] = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate|up",
                                                  "up": "gate|up", "gate_up": "gate|up"}.get(name, name)
        self.roles[id(model.lm_head.weight)] = "lm_head"
        self.saved = {k: getattr(ops, k) for k in KERNELS}
        for k in KERNELS:
            setattr(ops, k, self._wrap(k, self.saved[k]))

    def _wrap(self, kind: str, fn):
        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                label = f"linear {self.roles.get(id(args[1]), 'other')}" if kind == "linear" else kind
                self.acc[label] += time.perf_counter() - t
        return timed

    def restore(self) -> None:
        for k, fn in self.saved.items():
            setattr(ops, k, fn)


class StageTimers:
    """The fused path's stages, from the C library's own timers (library.decoder_profile)."""

    rest = "outside the layers"

    def __init__(self, model):
        model.fused = True

    def clear(self) -> None:  # the sums zeroed, the timers on: one forward's stages follow
        library.decoder_profile(True)

    def read(self) -> dict[str, float]:
        return library.decoder_profile()

    def restore(self) -> None:
        library.decoder_profile(False)


class PythonTimers(Timers):
    rest = "other"

    def __init__(self, model):
        model.fused = False
        super().__init__(model)

    def clear(self) -> None:
        self.acc.clear()

    def read(self) -> dict[str, float]:
        return dict(self.acc)


def measure(name: str, a: argparse.Namespace) -> dict:
    lm = load_model(name, LoadOptions("cpu", "auto", "auto"))
    cfg, model = lm.config, lm.model
    rows = [int(x) for x in a.rows.split(",")]
    bps = -(-(a.context + max(rows)) // BLOCK)
    kv = filled_cache(cfg, bps, "fp32")
    batches = {m: make_batch(m, a.context, "verify", bps, cfg.vocab_size) for m in rows}
    timers = (StageTimers if a.path == "fused" else PythonTimers)(model)
    samples: dict[int, list[dict[str, float]]] = {m: [] for m in rows}
    try:
        with torch.inference_mode():
            for m in rows:
                model.forward(batches[m], kv)  # warm-up
            for _ in range(a.rounds):
                for m in rows:
                    timers.clear()
                    t = time.perf_counter()
                    model.forward(batches[m], kv)
                    total = time.perf_counter() - t
                    cell = timers.read()
                    cell[timers.rest] = total - sum(cell.values())
                    cell["total"] = total
                    samples[m].append(cell)
    finally:
        timers.restore()
    labels = sorted({k for s in samples[rows[0]] for k in s}, key=lambda k: (k == "total", k == timers.rest, k))
    med = {m: {k: statistics.median(s.get(k, 0.0) for s in samples[m]) * 1e3 for k in labels} for m in rows}
    return {"model": name, "rows": rows, "context": a.context, "path": a.path, "median_ms": med, "labels": labels}


def markdown(results: list[dict]) -> str:
    out = []
    for r in results:
        rows, first, last = r["rows"], r["rows"][0], r["rows"][-1]
        path = "fused path, C stage timers" if r.get("path") == "fused" else "per-op path"
        out += [f"{r['model']}, context {r['context']}, {path} (ms per forward, median):", "",
                "| kernel | " + " | ".join(f"M={m}" for m in rows) + f" | M={last} / M={first} |",
                "|---|" + "---|" * (len(rows) + 1)]
        for k in r["labels"]:
            cells = [f"{r['median_ms'][m][k]:.2f}" for m in rows]
            base = r["median_ms"][first][k]
            ratio = f"{r['median_ms'][last][k] / base:.2f}" if base > 0.005 else "-"
            out.append(f"| {k} | " + " | ".join(cells) + f" | {ratio} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--path", choices=("python", "fused"), default="python")
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    set_threads(a.threads)
    results = [measure(m.strip(), a) for m in a.models.split(",")]
    text = markdown(results)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
