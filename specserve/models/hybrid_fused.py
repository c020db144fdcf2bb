"""The fused CPU path of hybrid models: their decoder layers in one C call (kernels/csrc/hybrid.h).

``HybridStack`` is to :class:`~specserve.models.hybrid.HybridTransformer` what
:class:`~specserve.models.fused.FusedStack` is to a dense model: the C descriptors of its layers
(weights, norms, the DeltaNet's conv / decay / gated-norm vectors, each layer's recurrent-state
pools) and of the KV pools of its attention layers; ``run`` executes the layers of a forward with
one ``ss_hybrid_layers`` call per segment. The C code chains the kernels the Python path calls
one by one (``HybridTransformer.run_layers``), on the same rows, so the result is bit-identical
to it (tests/test_hybrid_fused.py).

Covered: Qwen3.5 / Qwen3-Next layers with a dense MLP, any weight format, the DeltaNet's input
projections fused or apart, partial rotary, text rows and rows with images (their per-row M-RoPE
table), every KV cache dtype, the prefix cache's state checkpoints, mixtures of experts whose
experts share grouped kernel calls (csrc/moe_layer.h). Any other mixture of experts ends the C
call after its layer's mixer and runs in Python (``SparseMoE``); the next call goes on from the
next layer. Under tensor parallelism the C call sums the row-parallel outputs over the ranks
through the group's callback, as the dense stack does. CUDA and the torch kernel fallback take the
Python path.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import torch

from specserve.kernels import ops
from specserve.kernels.decoder_abi import HL_DOWN, HL_GATE, HL_IN, HL_OUT
from specserve.models.fused import FusedStack, _norm_ptr, _rows, model_desc
from specserve.models.fused import batch_supported as dense_batch_supported
from specserve.models.layers import rms_norm
from specserve.models.transformer import MLP

if TYPE_CHECKING:
    from specserve.models.hybrid import HybridTransformer
    from specserve.models.kv_cache import KVCache
    from specserve.models.transformer import ForwardBatch


def unsupported(model: HybridTransformer) -> str | None:
    """Why the model's layers cannot run fused (None: they can)."""
    cfg = model.cfg
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "CPU float32 only"
    if cfg.activation not in ops.ACTIVATIONS:
        return f"activation {cfg.activation}"
    if cfg.deltanet is None:
        return "no Gated DeltaNet shapes in the config"
    if 2 * model.rope_global.cos.shape[1] > cfg.head_dim:
        return "rotary table wider than a head"
    return None


def _index_ok(t: torch.Tensor | None, n: int) -> bool:
    return (t is not None and t.dtype == torch.int64 and t.shape == (n,) and t.is_contiguous()
            and t.device.type == "cpu")


def batch_supported(batch: ForwardBatch, kv: KVCache) -> bool:
    """Whether this batch and cache can run fused: the dense checks, one paging group, the
    recurrent-state indices, int32 rope positions when they are 1-D."""
    if not (dense_batch_supported(batch, kv) and len(batch.paging) == 1 and kv.states is not None):
        return False
    t, s = batch.positions.shape[0], batch.paging[0].block_tables.shape[0]
    rp = batch.rope_positions
    return (all(_index_ok(x, s) for x in (batch.state_slots, batch.state_read, batch.state_ckpt_read))
            and all(_index_ok(x, t) for x in (batch.state_write, batch.state_ckpt_write))
            and (rp is None or rp.dim() == 2 or (rp.dtype == torch.int32 and rp.shape == (t,) and rp.is_contiguous())))


def _ptr(t: torch.Tensor) -> int | None:
    return t.data_ptr() if t.numel() else None


def _vec(t: torch.Tensor, n: int, what: str) -> int:
    if not (t.dtype == torch.float32 and t.shape == (n,) and t.is_contiguous()):
        raise ValueError(f"hybrid layers: {what} must be a contiguous float32 [{n}] tensor")
    return t.data_ptr()


def _array(ctype, items: list):
    return (ctype * len(items))(*items)


def moe_struct(moe, cfg) -> tuple | None:
    """(SSMoE, the pointer arrays it holds) of a SparseMoE whose experts share grouped kernel calls,
    or None: it runs in Python (experts that cannot be grouped, a shared expert apart with gate and
    up apart, more than 64 experts a token)."""
    sh = moe.shared
    if not moe.can_group() or moe.moe.num_experts_per_tok > 64 or (
            sh is not None and not moe._fold_shared and sh.gate_up is None):
        return None
    mlps = [*moe.experts, sh] if moe._fold_shared else list(moe.experts)
    ups, downs = [m.gate_up.weight._c_args() for m in mlps], [m.down.weight._c_args() for m in mlps]
    keep = [_array(ctypes.c_void_p, [a[0] for a in ups]), _array(ctypes.c_void_p, [a[0] for a in downs])]
    if ups[0][3]:  # int8 weights: their per-row scales
        keep += [_array(ctypes.c_void_p, [a[3] for a in ups]), _array(ctypes.c_void_p, [a[3] for a in downs])]
    s = ops.SSMoE()
    s.router = ops.lin_struct(moe.router.weight, moe.router.bias)
    if sh is not None:
        s.shared_gate = ops.lin_struct(moe.shared_gate.weight, moe.shared_gate.bias)
        if not moe._fold_shared:
            s.shared_gu, s.shared_down = (ops.lin_struct(lin.weight, lin.bias) for lin in (sh.gate_up, sh.down))
    s.gate_up, s.down = (ctypes.addressof(a) for a in keep[:2])
    if len(keep) > 2:
        s.gu_scales, s.down_scales = (ctypes.addressof(a) for a in keep[2:])
    s.gu_fmt, s.down_fmt, s.E, s.k = ups[0][1], downs[0][1], moe.moe.num_experts, moe.moe.num_experts_per_tok
    s.width, s.renorm, s.fold_shared = moe.moe.intermediate_size, int(moe.moe.norm_topk_prob), int(moe._fold_shared)
    s.shared_width = moe.moe.shared_intermediate_size
    if moe.experts[0].gate_up.out_features != 2 * s.width or (
            s.shared_gu.n and sh.gate_up.out_features != 2 * s.shared_width):
        return None
    return s, keep


class HybridStack(FusedStack):
    """C descriptors of one hybrid model's layers and their state pools, and the call that runs them."""

    unsupported = staticmethod(unsupported)
    batch_supported = staticmethod(batch_supported)

    def __init__(self, model: HybridTransformer, lib):
        cfg, dn = model.cfg, model.cfg.deltanet
        self._cfg, self._modules, self._rope = cfg, list(model.layers), model.rope_global
        base, self._keep = model_desc(cfg, model.rope_global)  # the rope table: [max_pos, rot / 2]
        self.model_desc = ops.SSHybridModel(base, 2 * self._keep[0].shape[1], dn.num_k_heads, dn.num_v_heads,
                                            dn.k_head_dim, dn.v_head_dim, dn.conv_kernel, int(dn.v_tiled))
        # mixtures of experts run in C where their experts can share a grouped call, else in Python
        # between calls (SparseMoE: routing and grouped experts in C calls of their own)
        self._moe = self._moe_structs()  # (rebuilt with the layers: the shared expert's int_dot is in them)
        self.breaks = frozenset(i for i, m in self._moe.items() if m is None)
        described = [lin for i, layer in enumerate(self._modules)
                     for lin in (*self._lins(i, layer).values(), *self._moe_lins(i, layer))]
        self._setup(model, lib, self.model_desc.m, described)
        self._layers_kv = None  # the cache whose state pools the layer descriptors point into

    def _moe_structs(self) -> dict:
        return {i: moe_struct(layer.mlp, self._cfg) for i, layer in enumerate(self._modules)
                if not isinstance(layer.mlp, MLP)}

    def _moe_lins(self, i: int, layer) -> list:
        """The linears of layer i's mixture of experts that its SSMoE describes as SSLins (the grouped
        experts' int_dot plays no part: their calls always take the integer-dot path)."""
        if self._moe.get(i) is None:
            return []
        mlp = layer.mlp
        shared_apart = [mlp.shared.gate_up, mlp.shared.down] if mlp.shared is not None and not mlp._fold_shared else []
        return [mlp.router, *([mlp.shared_gate] if mlp.shared is not None else []), *shared_apart]

    def _after(self, layer: int, x: torch.Tensor) -> None:
        """Layer ``layer``'s mixture of experts on x, in place (run_layers' residual)."""
        mod = self._modules[layer]
        x += mod.mlp(rms_norm(x, mod.ffn_norm, self._cfg.rms_eps))

    def _lins(self, i: int, layer) -> dict:
        """Layer i's linears by SSHybridLayer.lin slot: the mixer's, and the dense MLP's."""
        mixer, mlp = layer.mixer, layer.mlp
        if self._cfg.is_linear(i):
            ins = ([mixer.in_proj] if mixer.in_proj is not None else [mixer.qkv, mixer.zba] if mixer.zba is not None
                   else [mixer.qkv, mixer.z, mixer.b, mixer.a])
            lins = {HL_IN + j: lin for j, lin in enumerate(ins)} | {HL_OUT: mixer.out}
        else:
            qkv = [mixer.qkv] if mixer.qkv is not None else [mixer.q, mixer.k, mixer.v]
            lins = {j: lin for j, lin in enumerate(qkv)} | {HL_OUT: mixer.o}
        if not isinstance(mlp, MLP):  # a mixture of experts: its SSMoE, or Python between calls
            return lins
        gate_up = [mlp.gate_up] if mlp.gate_up is not None else [mlp.gate, mlp.up]
        return lins | {HL_GATE + j: lin for j, lin in enumerate(gate_up)} | {HL_DOWN: mlp.down}

    def _layer_struct(self, i: int, layer, states) -> ops.SSHybridLayer:
        cfg, s, mixer = self._cfg, ops.SSHybridLayer(), layer.mixer
        s.attn_norm, s.ffn_norm = (_norm_ptr(w, cfg.hidden_size) for w in (layer.attn_norm, layer.ffn_norm))
        for j, lin in self._lins(i, layer).items():
            s.lin[j] = ops.lin_struct(lin.weight, lin.bias)
        if i in self.breaks:
            s.mlp_outside = 1
        elif i in self._moe:
            s.moe = ctypes.addressof(self._moe[i][0])
        if not cfg.is_linear(i):
            s.q_norm, s.k_norm = _norm_ptr(mixer.q_norm, cfg.head_dim), _norm_ptr(mixer.k_norm, cfg.head_dim)
            return s
        dn = cfg.deltanet
        s.linear = 1
        s.conv_wt = _vec(mixer.conv_wt.reshape(-1), dn.conv_kernel * dn.conv_dim, "conv weights")
        s.A, s.dt_bias = _vec(mixer.A, dn.num_v_heads, "A"), _vec(mixer.dt_bias, dn.num_v_heads, "dt_bias")
        s.gnorm = _vec(mixer.norm, dn.v_head_dim, "the gated norm")
        conv, ssm, conv_ck, ssm_ck = (states.conv[i], states.ssm[i], states.conv_ckpt[i], states.ssm_ckpt[i])
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (conv, ssm, conv_ck, ssm_ck)):
            raise ValueError(f"hybrid layers: layer {i}'s recurrent states must be contiguous float32")
        s.conv, s.ssm, s.conv_ckpt, s.ssm_ckpt = map(_ptr, (conv, ssm, conv_ck, ssm_ck))
        s.slots, s.planes, s.ckpts = conv.shape[0], conv.shape[1], conv_ck.shape[0]
        return s

    def _hybrid_layers(self, kv: KVCache):
        """SSHybridLayer per layer (rebuilt when a weight's integer-dot path switches or another cache comes)."""
        key = self._act_key()
        if key != self._layers_key or self._layers_kv is None or self._layers_kv() is not kv:
            self._moe = self._moe_structs()
            arr = (ops.SSHybridLayer * self.num_layers)()
            for i, layer in enumerate(self._modules):
                arr[i] = self._layer_struct(i, layer, kv.states)
            self._layers, self._layers_key, self._layers_kv = arr, key, weakref.ref(kv)
        return self._layers

    def _prepare(self, batch: ForwardBatch, kv: KVCache, x: torch.Tensor):
        layers, pools = self._hybrid_layers(kv), self._pool_array(kv)
        rows = _rows(batch, batch.paging[0])
        table, pos = self._rope.for_batch(batch, self._cfg.mrope_section)  # with images: per-row M-RoPE
        states = ops.SSStateRows(*(t.data_ptr() for t in (batch.state_slots, batch.state_read, batch.state_ckpt_read,
                                                          batch.state_write, batch.state_ckpt_write, pos)))
        if table is not self._rope:  # (Rope.rows' tables are contiguous)
            states.rope_cos, states.rope_sin, states.rope_rows = table.cos.data_ptr(), table.sin.data_ptr(), len(pos)
        # pos and table (tensors the descriptors point into) stay alive with the closure
        return lambda l0, l1, keep=(pos, table): self._reduced(ops.hybrid_layers, self.lib, self.model_desc, layers,
                                                               pools, l0, l1, rows, states, x)
