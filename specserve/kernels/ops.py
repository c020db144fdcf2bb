"""Batch-invariant CPU kernels (linear, paged attention, RMSNorm).

Every per-row result is bit-identical whatever the number of rows in the call
and whatever the thread count: each output element is reduced by one thread
in a fixed order (see ``csrc/cpu_kernels.c``). This is what lets speculative
decoding (verification of k draft tokens in one call) reproduce plain greedy
decoding token for token.

Linear layers with int8 or GGUF block weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)
use integer dot products by default, as llama.cpp does: each row of x is
quantized to int8 per block of 32 values (256 for Q4_K / Q6_K) with one fp32
scale per block, dx = max|x| / 127, q = round_half_even(x * (1 / dx)) (see
``quantize_activations``), and every weight block is multiplied with it in
exact int32 arithmetic; the float combination of the block results has a
fixed order per output (``csrc/linear_panel.h``), so batch invariance holds as
before. The weights are repacked at load into panels of 16 output channels
whose blocks sit side by side (``csrc/panel_pack.c``): one 64-byte vector
holds the same 4 input positions of 16 channels, every activation word is
broadcast to all of them, and no output needs a sum across lanes, so a
verification of 8 rows reads each weight once for all 8 (the packing is a
bijection: ``raw``, ``rows`` and ``dequantize`` rebuild the file's blocks). The price is the activation rounding, at most max|x_block| / 254 per
value, as in llama.cpp. Measured against fp32 activations: one layer's
outputs move by up to ~1% of max |y| (tests/test_kernels.py, outlier-heavy
x); end to end, the logits move by ~3% (relative L2) on smollm2-135m (32-value
blocks) and ~6% on qwen2.5-coder-1.5b, where the 256-value blocks of the
K-quants cost most (32-value blocks would give ~1.7% there, at the price of a
float multiply-add per 64 values instead of per 256). A weight built with
``int_dot=False`` (or an int8 weight whose K is not a multiple of 32) keeps
the fp32-activation path. The torch fallback quantizes the activations the
same way.

``rope`` and ``act_mul`` are the elementwise parts of a decoder layer in C
(``csrc/decoder.h``; rope gives the bits of the torch formula, act_mul is
within a few ulp of torch's silu / gelu), and ``decoder_layers`` runs a whole
stack of decoder layers in one call from descriptors (``SSLayer`` etc.; built
by ``specserve/models/fused.py``), chaining the same kernels as the per-op
path, so both give the same bits.

The C library is compiled on first use (``build.py``). Without a compiler a
pure-torch fallback is used: it processes one row (one query) per torch call,
so it is batch-invariant too, but slow. Force it with ``impl="torch"``, with
``set_default_impl("torch")`` or the environment variable
``SPECSERVE_KERNELS=torch`` (read on first use; ``SPECSERVE_KERNELS=c`` makes
a missing C library an error instead).
"""

from __future__ import annotations

# the kernels live in one module per kind; this module is their one public face (ops.X)
from .library import (  # noqa: F401
    ACT_BLOCK,
    DEQUANT_QTYPES,
    GGUF_QTYPES,
    KernelError,
    _ACT_AMIN,
    _ERRORS,
    _FMT_F32,
    _FMT_I8,
    _FMT_Q4_0,
    _FMT_Q4_1,
    _FMT_Q4_K,
    _FMT_Q6_K,
    _FMT_Q8_0,
    _check,
    _check_2d_float,
    _declare,
    _default_impl,
    _f32,
    _get_lib,
    _i32,
    _i64,
    _lib_cache,
    _lib_lock,
    _num_threads_override,
    _require,
    _select,
    _vp,
    get_num_threads,
    kernels_available,
    kernels_info,
    set_default_impl,
    set_num_threads,
)
from .linear import (  # noqa: F401
    F32Weight,
    GGUFBlockWeight,
    Int8Weight,
    Weight,
    _as_weight,
    _fallback_weight,
    _qtype_name,
    dequantize_blocks,
    linear,
    quantize_activations,
)
from .attention import (  # noqa: F401
    FP8_E4M3_MAX,
    KV_FORMATS,
    KV_INT4_GROUP,
    _check_i32_1d,
    _kv_format,
    kv_c_group,
    kv_dequantize,
    kv_int4_group,
    kv_quantize,
    kv_quantize_c,
    kv_row_bytes,
    kv_scale_shape,
    kv_store_dim,
    paged_attention,
)
from .pointwise import (  # noqa: F401
    ACTIVATIONS,
    _check_norm_args,
    _rms_row_torch,
    act_mul,
    add_rms_norm,
    argmax_rows,
    rms_norm,
    rope,
)
from .recurrent import gated_delta, sigmoid_mul  # noqa: F401
from .decoder_abi import (  # noqa: F401
    LIN_SLOTS,
    REDUCE_FN,
    SSKVPool,
    SSLayer,
    SSMoE,
    SSLin,
    SSModel,
    SSHybridLayer,
    SSHybridModel,
    SSRows,
    SSStateRows,
    decoder_layers,
    decoder_library,
    hybrid_layers,
    lin_struct,
)

__all__ = [
    "F32Weight",
    "Int8Weight",
    "GGUFBlockWeight",
    "dequantize_blocks",
    "DEQUANT_QTYPES",
    "GGUF_QTYPES",
    "ACT_BLOCK",
    "quantize_activations",
    "linear",
    "paged_attention",
    "KV_FORMATS",
    "KV_INT4_GROUP",
    "kv_quantize",
    "kv_quantize_c",
    "kv_dequantize",
    "kv_row_bytes",
    "rms_norm",
    "add_rms_norm",
    "rope",
    "act_mul",
    "argmax_rows",
    "gated_delta",
    "sigmoid_mul",
    "ACTIVATIONS",
    "decoder_library",
    "decoder_layers",
    "kernels_available",
    "kernels_info",
    "set_num_threads",
    "get_num_threads",
    "set_default_impl",
    "KernelError",
]


