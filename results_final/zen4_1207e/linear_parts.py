"""Every linear of a decode step of the 4-layer Qwen3.5-35B-A3B-shaped model (hybrid_speed.py
--model 35b-a3b --layers 4), by weight format and shape: calls a step, ms a call, MB of weights and
the speed they stream at (timers around each Linear call and each grouped experts' call, 40 steps);
then the LM head alone on a random row against the head inside the step, taking turns (4 turns of
20), which shows how far this VM's memory speed moves within minutes.

    python results_final/zen4_1207e/linear_parts.py > results_final/zen4_1207e/linear_parts.txt
    python results_final/zen4_1207e/linear_parts.py ~/.cache/specserve/bench/qwen35-0.8b-random/\
qwen35-0.8b-random-q4_k_m.gguf > results_final/zen4_1207e/linear_parts_08b.txt  (another file: hybrid_speed.py's)
"""

import collections
import sys
import time

import torch

from specserve.kernels import grouped
from specserve.models import hybrid
from specserve.models import layers as L

from moe_model import GGUF, decoding_engine


def nbytes(w) -> int:
    t = getattr(w, "packed", None)
    t = t if t is not None else getattr(w, "w", None)
    return t.numel() * t.element_size()


def main() -> None:
    m, eng = decoding_engine(path=sys.argv[1] if len(sys.argv) > 1 else GGUF)
    spent, calls, size = collections.defaultdict(float), collections.Counter(), {}
    lin_forward, group = L.Linear.forward, grouped.linear_group

    def lin(self, x):
        t = time.perf_counter()
        out = lin_forward(self, x)
        w = self.weight
        key = f"{type(w).__name__} {getattr(w, 'qtype', '')} {tuple(w.shape)}"
        spent[key] += time.perf_counter() - t
        calls[key] += 1
        size[key] = nbytes(w)
        return out

    def grp(xs, ws, out, **kw):
        t = time.perf_counter()
        res = group(xs, ws, out, **kw)
        key = f"experts grouped {ws[0].qtype} {tuple(ws[0].shape)} x{len(ws)}"
        spent[key] += time.perf_counter() - t
        calls[key] += 1
        size[key] = nbytes(ws[0]) * len(ws)
        return res

    L.Linear.__call__, hybrid.linear_group = lin, grp
    steps = 40
    for _ in range(steps):
        eng.step()
    L.Linear.__call__, hybrid.linear_group = lin_forward, group
    print(f"{'linear':48s} {'calls/step':>10s} {'ms/call':>8s} {'MB':>7s} {'GB/s':>5s}")
    for k in sorted(spent, key=lambda k: -spent[k]):
        per = spent[k] / calls[k] * 1e3
        print(f"{k:48s} {calls[k] / steps:10.1f} {per:8.3f} {size[k] / 1e6:7.2f} {size[k] / 1e6 / per:5.1f}")
    head, in_step = m.model.lm_head, [0.0]
    logits = m.model.logits

    def timed_logits(*a, **kw):
        t = time.perf_counter()
        out = logits(*a, **kw)
        in_step[0] += time.perf_counter() - t
        return out

    m.model.logits = timed_logits
    x = torch.randn(1, m.config.hidden_size)
    for _ in range(4):
        t0 = time.perf_counter()
        for _ in range(20):
            head(x)
        alone = (time.perf_counter() - t0) / 20 * 1e3
        in_step[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(20):
            eng.step()
        step = (time.perf_counter() - t0) / 20 * 1e3
        print(f"LM head alone {alone:.2f} ms ({nbytes(head.weight) / 1e6 / alone:.1f} GB/s); in the step "
              f"{in_step[0] / 20 * 1e3:.2f} ms; the step {step:.2f} ms")


if __name__ == "__main__":
    main()
