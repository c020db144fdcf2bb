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
from specserve.models.fused import FusedStack, _norm_ptr, _reduce_callback, _rows
from specserve.models.fused import batch_supported as dense_batch_supported
from specserve.models.layers import linears, rms_norm
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

    def __init__(self, model: HybridTransformer, lib):  # noqa: D107 (FusedStack's fields, hybrid ones)
        cfg, dn = model.cfg, model.cfg.deltanet
        self.lib, self.num_layers, self.hidden = lib, cfg.num_layers, cfg.hidden_size
        self._modules = list(model.layers)
        self._rope = model.rope_global
        cos, sin = model.rope_global.cos.contiguous(), model.rope_global.sin.contiguous()  # [max_pos, rot / 2]
        self._keep = [cos, sin]
        base = ops.SSModel(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                           cfg.rms_eps, cfg.scale, cfg.attn_softcap, ops.ACTIVATIONS[cfg.activation], cos.data_ptr(),
                           sin.data_ptr(), cos.shape[0])
        self.model_desc = ops.SSHybridModel(base, 2 * cos.shape[1], dn.num_k_heads, dn.num_v_heads, dn.k_head_dim,
                                            dn.v_head_dim, dn.conv_kernel, int(dn.v_tiled))
        self._dot_weights = [lin.weight for layer in self._modules for lin in linears(layer)
                             if hasattr(lin.weight, "int_dot")]
        self._cfg, self._layers, self._layers_key = cfg, None, None
        self._kv_ref, self._pools, self._reduce_errors = None, None, []
        if model.tp is not None:  # the row-parallel partial sums, summed over the ranks inside the call
            self._reduce = ops.REDUCE_FN(_reduce_callback(model.tp, self._reduce_errors))
            self.model_desc.m.reduce = self._reduce
        # mixtures of experts run in C where their experts can share a grouped call, else in Python
        # between calls (SparseMoE: routing and grouped experts in C calls of their own)
        self._moe = self._moe_structs()  # (rebuilt with the layers: the shared expert's int_dot is in them)
        self.breaks = frozenset(i for i, m in self._moe.items() if m is None)

    def _moe_structs(self) -> dict:
        return {i: moe_struct(layer.mlp, self._cfg) for i, layer in enumerate(self._modules)
                if not isinstance(layer.mlp, MLP)}

    def _after(self, layer: int, x: torch.Tensor) -> None:
        """Layer ``layer``'s mixture of experts on x, in place (run_layers' residual)."""
        mod = self._modules[layer]
        x += mod.mlp(rms_norm(x, mod.ffn_norm, self._cfg.rms_eps))

    def _layer_struct(self, i: int, layer, states) -> ops.SSHybridLayer:
        cfg, s = self._cfg, ops.SSHybridLayer()
        mixer, mlp = layer.mixer, layer.mlp
        s.attn_norm, s.ffn_norm = (_norm_ptr(w, cfg.hidden_size) for w in (layer.attn_norm, layer.ffn_norm))
        if cfg.is_linear(i):
            dn = cfg.deltanet
            ins = ([mixer.in_proj] if mixer.in_proj is not None else [mixer.qkv, mixer.zba] if mixer.zba is not None
                   else [mixer.qkv, mixer.z, mixer.b, mixer.a])
            lins = {HL_IN + j: lin for j, lin in enumerate(ins)} | {HL_OUT: mixer.out}
            s.linear = 1
            s.conv_wt = _vec(mixer.conv_wt.reshape(-1), dn.conv_kernel * dn.conv_dim, "conv weights")
            s.A, s.dt_bias = _vec(mixer.A, dn.num_v_heads, "A"), _vec(mixer.dt_bias, dn.num_v_heads, "dt_bias")
            s.gnorm = _vec(mixer.norm, dn.v_head_dim, "the gated norm")
            conv, ssm, conv_ck, ssm_ck = (states.conv[i], states.ssm[i], states.conv_ckpt[i], states.ssm_ckpt[i])
            if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (conv, ssm, conv_ck, ssm_ck)):
                raise ValueError(f"hybrid layers: layer {i}'s recurrent states must be contiguous float32")
            s.conv, s.ssm, s.conv_ckpt, s.ssm_ckpt = map(_ptr, (conv, ssm, conv_ck, ssm_ck))
            s.slots, s.planes, s.ckpts = conv.shape[0], conv.shape[1], conv_ck.shape[0]
        else:
            qkv = [mixer.qkv] if mixer.qkv is not None else [mixer.q, mixer.k, mixer.v]
            lins = {j: lin for j, lin in enumerate(qkv)} | {HL_OUT: mixer.o}
            s.q_norm, s.k_norm = _norm_ptr(mixer.q_norm, cfg.head_dim), _norm_ptr(mixer.k_norm, cfg.head_dim)
        if i in self.breaks:
            s.mlp_outside = 1
        elif i in self._moe:
            s.moe = ctypes.addressof(self._moe[i][0])
        else:
            gate_up = [mlp.gate_up] if mlp.gate_up is not None else [mlp.gate, mlp.up]
            lins |= {HL_GATE + j: lin for j, lin in enumerate(gate_up)} | {HL_DOWN: mlp.down}
        for j, lin in lins.items():
            s.lin[j] = ops.lin_struct(lin.weight, lin.bias)
        return s

    def _hybrid_layers(self, kv: KVCache):
        """SSHybridLayer per layer (rebuilt when a weight's integer-dot path switches or another cache comes)."""
        key = (self._act_key(), id(kv.states))
        if key != self._layers_key or self._kv_ref is None or self._kv_ref() is not kv:
            arr = (ops.SSHybridLayer * self.num_layers)()
            self._moe = self._moe_structs()
            for i, layer in enumerate(self._modules):
                arr[i] = self._layer_struct(i, layer, kv.states)
            self._layers, self._layers_key = arr, key
            self._kv_ref = None  # _pool_array rebuilds for this cache too
        return self._layers

    def _prepare(self, batch: ForwardBatch, kv: KVCache, x: torch.Tensor):
        layers = self._hybrid_layers(kv)
        pools = self._pool_array(kv)
        self._kv_ref = weakref.ref(kv)
        rows = _rows(batch, batch.paging[0])
        table, pos = self._rope.for_batch(batch, self._cfg.mrope_section)  # with images: per-row M-RoPE
        states = ops.SSStateRows(*(t.data_ptr() for t in (batch.state_slots, batch.state_read, batch.state_ckpt_read,
                                                          batch.state_write, batch.state_ckpt_write, pos)))
        if table is not self._rope:
            cos, sin = table.cos.contiguous(), table.sin.contiguous()
            states.rope_cos, states.rope_sin, states.rope_rows = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
            keep = (cos, sin, pos)  # alive for the calls
        else:
            keep = (pos,)
        return lambda l0, l1, keep=keep: self._reduced(ops.hybrid_layers, self.lib, self.model_desc, layers, pools,
                                                       l0, l1, rows, states, x)


HybridStack.unsupported = staticmethod(unsupported)
HybridStack.batch_supported = staticmethod(batch_supported)
