"""One decode step of the 4-layer Qwen3.5-35B-A3B-shaped model (hybrid_speed.py --model 35b-a3b
--layers 4) by part, with the bytes each part's weights (and a DeltaNet layer's state, read and
written) take, so each part's time reads as a speed: timers around the LM head, each layer's mixer
(Gated DeltaNet or gated attention) and MLP, and the step. ms per step, medians of 5 turns of 20 steps.

    python results_final/zen4_1207e/step_parts.py > results_final/zen4_1207e/step_parts.txt
"""

import statistics
import time

from specserve.models import hybrid

from moe_model import decoding_engine, timed

spent: dict[str, float] = {}


def weight_bytes(module) -> int:
    """Bytes of the weights one row reads (a MoE layer: its router, 8 routed experts, the shared one)."""
    if isinstance(module, hybrid.SparseMoE):
        one = sum(_lin_bytes(lin) for lin in (module.experts[0].gate_up, module.experts[0].down))
        k = module.moe.num_experts_per_tok
        return _lin_bytes(module.router) + _lin_bytes(module.shared_gate) + k * one + weight_bytes(module.shared)
    return sum(_lin_bytes(m) for m in module.modules() if type(m).__name__ == "Linear")


def _lin_bytes(lin) -> int:
    w = lin.weight
    t = getattr(w, "packed", None)
    t = t if t is not None else getattr(w, "w", None)
    return t.numel() * t.element_size()


def main() -> None:
    m, eng = decoding_engine()
    model = m.model
    model.logits = timed(spent, "LM head", model.logits)
    kinds = {hybrid.GatedDeltaNet: "DeltaNet mixers", hybrid.GatedAttention: "attention mixer",
             hybrid.SparseMoE: "MoE MLPs"}
    for cls, label in kinds.items():
        cls.__call__ = timed(spent, label, cls.forward)
    size = {label: 0 for label in kinds.values()}
    for layer in model.layers:
        for mod in (layer.mixer, layer.mlp):
            size[kinds[type(mod)]] += weight_bytes(mod)
    dn = model.cfg.deltanet
    size["DeltaNet mixers"] += 2 * 4 * dn.num_v_heads * dn.k_head_dim * dn.v_head_dim * len(model.cfg.linear_layers)
    size["LM head"] = _lin_bytes(model.lm_head)
    runs = []
    for _ in range(5):
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(20):
            eng.step()
        runs.append({"step": time.perf_counter() - t0, **spent})
    med = {k: statistics.median(r[k] for r in runs) / 20 * 1e3 for k in runs[0]}
    step = med.pop("step")
    print(f"decode step {step:.2f} ms; parts (ms per step, MB of weights, GB/s):")
    for k, v in med.items():
        mb = size.get(k, 0) / 1e6
        print(f"  {k:18s} {v:6.2f} ms  {mb:7.1f} MB  {mb / v:5.1f} GB/s" if mb else f"  {k:18s} {v:6.2f} ms")
    print(f"  {'the rest':18s} {step - sum(med.values()):6.2f} ms (the engine, embedding, norms, sampling)")


if __name__ == "__main__":
    main()
