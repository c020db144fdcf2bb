"""The mixture-of-experts layer's forward before 38ce98d (torch's routing, a few torch ops per
routed expert: its rows gathered, its output weighted and added back; the shared expert in calls
of its own) against today's (the routing in one C call, moe_combine, the shared expert in the
routed experts' kernel calls), taking turns in one process on the 4-layer Qwen3.5-35B-A3B-shaped
file (hybrid_speed.py --model 35b-a3b --layers 4). At 38ce98d both gave the same bits; since the
routing went to C (its softmax sums in index order) the outputs agree within a few ulp, checked
on every layer call of 5 steps here.

    python results_final/zen4_1207e/moe_ab.py > results_final/zen4_1207e/moe_ab.txt
"""

import statistics
import time

import torch

from specserve.kernels import ops
from specserve.kernels.grouped import linear_group
from specserve.models import hybrid
from specserve.models.layers import act_mul, route_top_k

from moe_model import decoding_engine

NEW = hybrid.SparseMoE.forward


def old_forward(self, h: torch.Tensor) -> torch.Tensor:  # the parent commit's SparseMoE.forward
    weight, groups = route_top_k(self.router(h), self.moe.num_experts_per_tok, self.moe.norm_topk_prob)
    out = torch.zeros_like(h)
    experts = [self.experts[e] for e, _, _ in groups]
    xs = [h[rows] for _, rows, _ in groups]
    sizes = [x.shape[0] for x in xs]
    gate_up = [ex.gate_up for ex in experts]
    both = linear_group(xs, [g.weight for g in gate_up], torch.empty(sum(sizes), gate_up[0].out_features))
    act = act_mul(*both.chunk(2, dim=-1), experts[0].activation)
    down = linear_group(list(act.split(sizes)), [ex.down.weight for ex in experts],
                        torch.empty(sum(sizes), experts[0].down.out_features))
    for (e, rows, slot), y in zip(groups, down.split(sizes)):
        out[rows] += y * weight[rows, slot, None]
    shared = self.shared(h)
    out += ops.sigmoid_mul(self.shared_gate(h).expand_as(shared).contiguous(), shared)
    return out


def main() -> None:
    m, eng = decoding_engine()
    moes = [layer.mlp for layer in m.model.layers]
    same = 0

    def checked(self, h):
        nonlocal same
        got = NEW(self, h)
        assert torch.allclose(got, old_forward(self, h), rtol=1e-5, atol=1e-6 * float(got.abs().max()))
        same += 1
        return got

    hybrid.SparseMoE.__call__ = checked
    for _ in range(5):
        eng.step()
    runs = {"before": [], "after": []}
    for _ in range(6):  # taking turns, 20 steps each
        for label, fwd in (("before", old_forward), ("after", NEW)):
            hybrid.SparseMoE.__call__ = fwd
            t0 = time.perf_counter()
            for _ in range(20):
                eng.step()
            runs[label].append((time.perf_counter() - t0) / 20 * 1e3)
    h = torch.randn(1, m.config.hidden_size)
    layer = {label: statistics.median(_time(lambda: fwd(moes[0], h)) for _ in range(5))
             for label, fwd in (("before", old_forward), ("after", NEW))}
    print(f"the same outputs before and after (within 1e-5) on {same} layer calls")
    for label, r in runs.items():
        print(f"{label}: decode step {statistics.median(r):.2f} ms (median of 6 turns of 20 steps; all "
              + ", ".join(f"{x:.2f}" for x in r) + f"); one MoE layer, one fixed row: {layer[label]:.3f} ms")
    print(f"after / before, decode step: {statistics.median(runs['after']) / statistics.median(runs['before']):.3f}")


def _time(fn, n: int = 200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


if __name__ == "__main__":
    main()
