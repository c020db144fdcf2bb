"""The fused decoder's C descriptors (SSLin, SSLayer, SSKVPool, SSModel, SSRows) and its entry point."""

from __future__ import annotations

import ctypes

import torch

from .library import _check, _f32, _i64, _select, _vp, get_num_threads
from .linear import Weight, _as_weight

# --------------------------------------------------------------------------
# a stack of decoder layers in one call (csrc/decoder.h)
# --------------------------------------------------------------------------


class SSLin(ctypes.Structure):
    """One linear layer's weight; n == 0: absent."""

    _fields_ = [("w", _vp), ("scale", _vp), ("bias", _vp), ("n", _i64), ("row_bytes", _i64),
                ("fmt", ctypes.c_int32), ("int_dot", ctypes.c_int32)]


# SSLayer.lin slots
LIN_SLOTS = ("q", "k", "v", "o", "gate", "up", "down")


class SSLayer(ctypes.Structure):
    """One decoder layer: lin[0] is the fused q|k|v weight when lin[1].n == 0, lin[4] the fused
    gate|up weight when lin[5].n == 0; q_norm / k_norm are NULL without qk-norm, post_attn_norm /
    post_ffn_norm without sandwich norms (Gemma 3), rope_cos / rope_sin when the layer uses the
    model's rope table."""

    _fields_ = [("lin", SSLin * len(LIN_SLOTS)), ("attn_norm", _vp), ("ffn_norm", _vp), ("q_norm", _vp),
                ("k_norm", _vp), ("window", _i64), ("post_attn_norm", _vp), ("post_ffn_norm", _vp),
                ("rope_cos", _vp), ("rope_sin", _vp)]


class SSKVPool(ctypes.Structure):
    """One layer's K / V pools [num_blocks, block_size, Hkv, D] in a KV_FORMATS format, with their
    scale pools (None for the unscaled formats), the int4 group and the paging group the layer's
    rows go through (KVCache.group: 0 the first rows, 1 the second)."""

    _fields_ = [("k", _vp), ("v", _vp), ("k_scales", _vp), ("v_scales", _vp), ("num_blocks", _i64),
                ("block_size", _i64), ("fmt", ctypes.c_int32), ("group", ctypes.c_int32), ("paging", ctypes.c_int32)]


# tensor parallel: int reduce(float *x, int64_t n, void *ctx), x summed over the ranks in place
REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _i64, ctypes.c_void_p)


class SSModel(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("n_heads", _i64), ("n_kv_heads", _i64), ("head_dim", _i64), ("inter", _i64),
                ("eps", _f32), ("scale", _f32), ("softcap", _f32), ("act", ctypes.c_int32),
                ("rope_cos", _vp), ("rope_sin", _vp), ("rope_max_pos", _i64), ("reduce", REDUCE_FN),
                ("reduce_ctx", _vp)]


class SSRows(ctypes.Structure):
    _fields_ = [("T", _i64), ("positions", _vp), ("seq_ids", _vp), ("slots", _vp), ("block_tables", _vp),
                ("S", _i64), ("max_blocks", _i64)]


def lin_struct(w: Weight, bias: torch.Tensor | None) -> SSLin:
    """The SSLin of one weight, with the kernel ops.linear would choose (integer dot or fp32)."""
    w = _as_weight(w)
    wptr, fmt, row_bytes, sptr = w._c_args()
    if bias is not None and not (bias.dtype == torch.float32 and bias.shape == (w.n,) and bias.is_contiguous()):
        raise ValueError(f"decoder layers: bias must be a contiguous float32 [{w.n}] tensor")
    return SSLin(wptr, sptr or None, None if bias is None else bias.data_ptr(), w.n, row_bytes, fmt,
                 int(w.act_block is not None))


def decoder_library(impl: str | None = None) -> ctypes.CDLL | None:
    """The C library when the fused decoder-layer path can run (None: torch fallback selected or
    no compiler)."""
    return _select(impl)


def decoder_layers(lib: ctypes.CDLL, model: SSModel, layers: ctypes.Array, pools: ctypes.Array, l0: int,
                   l1: int, rows: SSRows, window_rows: SSRows | None, x: torch.Tensor) -> None:
    """Run layers l0 .. l1 - 1 on x [T, hidden] in place (csrc/decoder.h: ss_decoder_layers);
    window_rows: the slots / block tables of the sliding-window layers' own pools, or None.

    The caller validates the descriptors once (models/fused.py); x must be a contiguous float32
    [T, hidden] tensor."""
    _check(lib.ss_decoder_layers(ctypes.byref(model), layers, pools, l0, l1, ctypes.byref(rows),
                                 None if window_rows is None else ctypes.byref(window_rows), x.data_ptr(),
                                 get_num_threads()), "decoder_layers")


# --------------------------------------------------------------------------
# a stack of hybrid (Gated DeltaNet / gated attention) layers in one call (csrc/hybrid.h)
# --------------------------------------------------------------------------

# SSHybridLayer.lin slots: a DeltaNet layer's q|k|v, z, b, a (side by side; absent ones skipped)
# and out; an attention layer's q (query | gate per head), k, v and o; the MLP's gate, up, down
HYBRID_SLOTS = 8
HL_IN, HL_OUT, HL_GATE, HL_DOWN = 0, 4, 5, 7


class SSMoE(ctypes.Structure):
    """One layer's mixture of experts (csrc/moe_layer.h): gate_up / down point at arrays of E (+1:
    the shared expert folded in) weight pointers, gu_scales / down_scales at their int8 scales."""

    _fields_ = [("router", SSLin), ("shared_gate", SSLin), ("shared_gu", SSLin), ("shared_down", SSLin),
                ("gate_up", _vp), ("down", _vp), ("gu_scales", _vp), ("down_scales", _vp),
                ("gu_fmt", ctypes.c_int32), ("down_fmt", ctypes.c_int32), ("E", _i64), ("k", _i64), ("width", _i64),
                ("shared_width", _i64), ("renorm", ctypes.c_int32), ("fold_shared", ctypes.c_int32)]


class SSHybridLayer(ctypes.Structure):
    _fields_ = [("lin", SSLin * HYBRID_SLOTS), ("attn_norm", _vp), ("ffn_norm", _vp), ("q_norm", _vp),
                ("k_norm", _vp), ("conv_wt", _vp), ("A", _vp), ("dt_bias", _vp), ("gnorm", _vp), ("conv", _vp),
                ("ssm", _vp), ("conv_ckpt", _vp), ("ssm_ckpt", _vp), ("slots", _i64), ("planes", _i64),
                ("ckpts", _i64), ("linear", ctypes.c_int32), ("mlp_outside", ctypes.c_int32),
                ("moe", _vp)]


class SSHybridModel(ctypes.Structure):
    _fields_ = [("m", SSModel), ("rot", _i64), ("Hk", _i64), ("Hv", _i64), ("dk", _i64), ("dv", _i64),
                ("conv_k", _i64), ("v_tiled", ctypes.c_int32)]


class SSStateRows(ctypes.Structure):
    _fields_ = [("slots", _vp), ("read", _vp), ("ckpt_read", _vp), ("write", _vp), ("ckpt_write", _vp),
                ("rope_pos", _vp), ("rope_cos", _vp), ("rope_sin", _vp), ("rope_rows", _i64)]


def hybrid_layers(lib: ctypes.CDLL, model: SSHybridModel, layers: ctypes.Array, pools: ctypes.Array, l0: int,
                  l1: int, rows: SSRows, states: SSStateRows, x: torch.Tensor) -> None:
    """Run hybrid layers l0 .. l1 - 1 on x [T, hidden] in place (csrc/hybrid.h: ss_hybrid_layers).
    The caller (models/hybrid_fused.py) validates the descriptors and the batch."""
    _check(lib.ss_hybrid_layers(ctypes.byref(model), layers, pools, l0, l1, ctypes.byref(rows),
                                ctypes.byref(states), x.data_ptr(), get_num_threads()), "hybrid_layers")
