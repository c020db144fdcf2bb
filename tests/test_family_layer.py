"""A drafter's layer at inference is the target family's module (speculative/family_layer.py),
built from the weights of its differentiable training layer (speculative/layers.py): the two
forms compute the same function — dense and gated attention, qk-norm, q/k/v biases, partial
rotary, M-RoPE, a mixture-of-experts MLP — over kept rows and a causal block."""

from __future__ import annotations

import pytest
import torch

from specserve.models.config import ModelConfig
from specserve.models.hybrid import HybridLayer
from specserve.models.layers import linears
from specserve.models.transformer import DecoderLayer
from specserve.speculative.family_layer import DrafterLayers, LayerShape, family_name, weight_format
from specserve.speculative.layers import TrainableLayer

TARGET = ModelConfig(arch="qwen3", vocab_size=256, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=8, rms_eps=1e-6, rope_theta=10000.0, max_position=256,
                     activation="gelu_tanh", sandwich_norms=True, attn_softcap=30.0)  # none of it is the drafter's
H, HEADS, KVH, D, INTER = 64, 4, 2, 16, 96
CASES = {
    "dense": dict(qkv_bias=True),
    "dense_qk_norm": dict(qk_norm=True),
    "gated_partial_rotary": dict(qk_norm=True, output_gate=True, rotary_dim=8),
    "gated_moe_mrope": dict(qk_norm=True, output_gate=True, rotary_dim=8, moe=(4, 2, 32, 48, True),
                            mrope_section=(2, 1, 1)),
}


def _training_layer(kw: dict, seed: int = 0) -> TrainableLayer:
    torch.manual_seed(seed)
    layer = TrainableLayer(H, HEADS, KVH, D, INTER, 1e-6, 10000.0, kw.get("qk_norm", False), kw.get("qkv_bias", False),
                         kw.get("output_gate", False), kw.get("rotary_dim", 0), kw.get("moe"),
                         kw.get("mrope_section", ()))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 and "norm" in name else 0.2 * torch.randn_like(p))
    return layer


def _positions(kw: dict, start: int, n: int) -> torch.Tensor:
    """[n], or [n, 3] (t, h, w) with h and w apart from t, for an M-RoPE layer."""
    t = torch.arange(start, start + n)
    if not kw.get("mrope_section"):
        return t
    return torch.stack([t, t % 3 + start, t // 2 + start], dim=-1)


@pytest.mark.parametrize("case", CASES)
def test_family_layer_computes_the_training_layer(case):
    kw = CASES[case]
    train = _training_layer(kw)
    shape = LayerShape(H, HEADS, KVH, D, INTER, 1e-6, 10000.0, **kw)
    stack = DrafterLayers(shape, TARGET, [train.state_dict()], "none", torch.device("cpu"))
    assert isinstance(stack.layers[0], HybridLayer if kw.get("output_gate") else DecoderLayer)
    C, T = 7, 5
    ctx_h = torch.randn(C, H)
    ctx_pos, pos = _positions(kw, 0, C), _positions(kw, C, T)
    ck, cv = train.kv(ctx_h[None], ctx_pos[None])  # [1, C, kvh, D]
    x = torch.randn(T, H)
    mask = torch.cat([torch.ones(T, C, dtype=torch.bool), torch.ones(T, T, dtype=torch.bool).tril()], dim=-1)
    with torch.no_grad():
        want, (wk, wv) = train(x[None], pos[None], ck, cv, mask[None], return_kv=True)
    attention = stack.attention(ck[0], cv[0], causal=True)
    got = stack.run(0, x, pos, attention)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(attention.k, wk[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention.v, wv[0], rtol=1e-5, atol=1e-5)
    # one row seeing everything kept (an MTP chain step, a dflash block row)
    with torch.no_grad():
        want1 = train(x[None, :1], pos[None, :1], ck, cv, None)
    torch.testing.assert_close(stack.run(0, x[:1], pos[:1], stack.attention(ck[0], cv[0])), want1[0],
                               rtol=1e-4, atol=1e-4)
    if not kw.get("output_gate"):  # a dflash context row: keys and values alone
        k, v = stack.keys_values(0, ctx_h, ctx_pos)
        torch.testing.assert_close(k, ck[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, cv[0], rtol=1e-5, atol=1e-5)


def test_int8_family_layer_is_close_and_int8():
    """"quantization": "int8" (the CPU default of dflash and MTP): every linear of the layer in
    the kernels' int8 format but the mixture's router and shared-expert gate, which stay float32 as
    the model's do; the output near the float32 one."""
    from specserve.models.hybrid import SparseMoE

    kw = CASES["gated_moe_mrope"]
    train = _training_layer(kw, seed=1)
    shape = LayerShape(H, HEADS, KVH, D, INTER, 1e-6, 10000.0, **kw)
    f32, i8 = (DrafterLayers(shape, TARGET, [train.state_dict()], q, torch.device("cpu")) for q in ("none", "int8"))
    moe = next(m for m in i8.modules() if isinstance(m, SparseMoE))
    gates = (moe.router, moe.shared_gate)
    assert {lin.format for lin in linears(i8) if not any(lin is g for g in gates)} == {"int8"}
    assert {g.format for g in gates} == {"fp32"} and {lin.format for lin in linears(f32)} == {"fp32"}
    x, pos = torch.randn(3, H), _positions(kw, 0, 3)
    a, b = (s.run(0, x, pos, s.attention(causal=True)) for s in (f32, i8))
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_names_and_weight_formats():
    assert family_name("q.bias") == "layers.0.q_bias" and family_name("attn_norm") == "layers.0.attn_norm"
    assert family_name("moe.experts.3.down.weight") == "layers.0.expert3.down"
    assert family_name("moe.shared.gate.weight") == "layers.0.shexp.gate"
    assert family_name("moe.shared_gate.weight") == "layers.0.shexp_gate"
    assert family_name("moe.router.weight") == "layers.0.router"
    assert weight_format(None, "mtp") == "int8" and weight_format("none", "mtp") == "float32"
    with pytest.raises(Exception, match='"int8".*"none".*q4_0'):
        weight_format("q4_0", "mtp")
