"""KV cache storage formats (quantize / dequantize) and paged attention."""

from __future__ import annotations

import torch

from .library import KernelError, _check, _select, get_num_threads

# --------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------


def _check_i32_1d(t: torch.Tensor, name: str, n: int) -> None:
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1 and t.shape[0] == n
            and t.is_contiguous() and t.device.type == "cpu"):
        raise ValueError(f"paged_attention: {name} must be a contiguous int32 CPU tensor of shape ({n},), "
                         f"got {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


# KV cache formats: name -> (C format id, storage dtype). Per (slot, kv head) row of D values:
#   fp32 / bf16 / fp16: D values of that dtype (bf16/fp16: round to nearest even on write).
#   fp8_e4m3: D e4m3fn bytes (uint8 storage) + one fp32 scale = absmax / 448: x ~= fp8 * scale.
#   int8: D int8 + one fp32 scale = absmax / 127 (symmetric): x ~= q * scale.
#   int4: D / 2 bytes (element 2i in the low nibble of byte i, 2i+1 in the high one), asymmetric
#         per group of KV_INT4_GROUP values along head_dim with fp32 (scale, min):
#         scale = (max - min) / 15, q = round((x - min) / scale) in [0, 15], x ~= q * scale + min.
# Quantization (kv_quantize) is elementwise given per-row / per-group max and min, which are exact
# whatever the reduction order, so a token's stored bytes depend on its K/V values only.
KV_FORMATS: dict[str, tuple[int, torch.dtype]] = {
    "fp32": (0, torch.float32),
    "bf16": (1, torch.bfloat16),
    "fp16": (2, torch.float16),
    "fp8_e4m3": (3, torch.uint8),
    "int8": (4, torch.int8),
    "int4": (5, torch.uint8),
}
KV_INT4_GROUP = 32
FP8_E4M3_MAX = 448.0


def _kv_format(kv_dtype: str) -> tuple[int, torch.dtype]:
    try:
        return KV_FORMATS[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r} (expected one of {', '.join(KV_FORMATS)})") from None


def kv_int4_group(head_dim: int) -> int:
    """int4 group size along head_dim: 32, or the whole (even) head when 32 does not divide it."""
    if head_dim % 2:
        raise ValueError(f"int4 KV cache needs an even head_dim, got {head_dim}")
    return KV_INT4_GROUP if head_dim % KV_INT4_GROUP == 0 else head_dim


def kv_c_group(kv_dtype: str, head_dim: int) -> int:
    """The group argument of the C KV kernels: int4's group size, 0 for the other formats."""
    return kv_int4_group(head_dim) if kv_dtype == "int4" else 0


def kv_scale_shape(kv_dtype: str, head_dim: int) -> tuple[int, ...] | None:
    """Trailing shape of the scale pool per (slot, kv head): () for fp8/int8, (groups, 2) for int4,
    None for unscaled formats."""
    if kv_dtype in ("fp8_e4m3", "int8"):
        return ()
    if kv_dtype == "int4":
        return (head_dim // kv_int4_group(head_dim), 2)
    _kv_format(kv_dtype)
    return None


def kv_store_dim(kv_dtype: str, head_dim: int) -> int:
    """Last dimension of the K/V pools (head_dim, or head_dim / 2 bytes for int4)."""
    return head_dim // 2 if kv_dtype == "int4" else head_dim


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Exact bytes one (token, kv head) row of K (or of V) takes, scales included."""
    _, dt = _kv_format(kv_dtype)
    elem = torch.tensor([], dtype=dt).element_size()
    n = kv_store_dim(kv_dtype, head_dim) * elem
    ss = kv_scale_shape(kv_dtype, head_dim)
    if ss is not None:
        cnt = 1
        for x in ss:
            cnt *= x
        n += 4 * cnt
    return n


def kv_quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] (float) -> (data in the storage dtype, scales float32 or None). See KV_FORMATS."""
    _, dt = _kv_format(kv_dtype)
    if kv_dtype in ("fp32", "bf16", "fp16"):
        return x.to(dt).contiguous(), None
    x = x.float()
    if kv_dtype in ("int8", "fp8_e4m3"):
        qmax = 127.0 if kv_dtype == "int8" else FP8_E4M3_MAX
        s = x.abs().amax(dim=-1) / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        y = x / s.unsqueeze(-1)
        if kv_dtype == "int8":
            data = torch.round(y).clamp_(-127, 127).to(torch.int8)
        else:
            data = y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return data.contiguous(), s.contiguous()
    # int4
    D = x.shape[-1]
    G = kv_int4_group(D)
    xg = x.reshape(*x.shape[:-1], D // G, G)
    mn = xg.amin(dim=-1)
    s = (xg.amax(dim=-1) - mn) / 15.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((xg - mn.unsqueeze(-1)) / s.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(*x.shape[:-1], D)
    data = q[..., 0::2] | (q[..., 1::2] << 4)
    return data.contiguous(), torch.stack((s, mn), dim=-1).contiguous()


def kv_quantize_c(x: torch.Tensor, kv_dtype: str, impl: str | None = "c") -> tuple[torch.Tensor, torch.Tensor | None]:
    """kv_quantize done by the C kernels (what the fused decoder path writes into the cache):
    x [N, D] float32 -> the same (data, scales) bits for finite inputs."""
    lib = _select(impl)
    if lib is None:
        raise KernelError("kv_quantize_c: the C kernels are not available")
    fmt, dt = _kv_format(kv_dtype)
    x = x.float().contiguous()
    n, d = x.shape
    data = torch.empty(n, kv_store_dim(kv_dtype, d), dtype=dt)
    sshape = kv_scale_shape(kv_dtype, d)
    scales = None if sshape is None else torch.empty(n, *sshape, dtype=torch.float32)
    _check(lib.ss_kv_quantize(fmt, x.data_ptr(), n, d, kv_c_group(kv_dtype, d), data.data_ptr(),
                              None if scales is None else scales.data_ptr()), "kv_quantize_c")
    return data, scales


def kv_dequantize(data: torch.Tensor, scales: torch.Tensor | None, kv_dtype: str) -> torch.Tensor:
    """Inverse of kv_quantize: float32 [..., D]; the same arithmetic as the C kernel's reads."""
    _kv_format(kv_dtype)
    if kv_dtype in ("fp32", "bf16", "fp16"):
        return data.float()
    if kv_dtype == "int8":
        return data.float() * scales.unsqueeze(-1)
    if kv_dtype == "fp8_e4m3":
        return data.view(torch.float8_e4m3fn).float() * scales.unsqueeze(-1)
    lo, hi = data & 15, data >> 4
    D = data.shape[-1] * 2
    G = kv_int4_group(D)
    q = torch.stack((lo, hi), dim=-1).reshape(*data.shape[:-1], D // G, G).float()
    out = q * scales[..., 0].unsqueeze(-1) + scales[..., 1].unsqueeze(-1)
    return out.reshape(*data.shape[:-1], D)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_ids: torch.Tensor, positions: torch.Tensor, scale: float, sliding_window: int = 0,
                    softcap: float = 0.0, *, kv_dtype: str = "fp32", k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """Causal attention of T queries over a paged KV cache.

    q [T, Hq, D] f32; k_cache / v_cache [num_blocks, block_size, Hkv, D] f32;
    block_tables [S, max_blocks] int32; seq_ids [T] int32 (row of
    block_tables); positions [T] int32 (the query attends to keys 0..pos of
    its sequence; key p lives in block block_tables[s][p // block_size] at
    offset p % block_size). GQA: head h uses kv head h // (Hq // Hkv).
    sliding_window > 0 keeps keys with pos - key_pos < window. softcap > 0
    applies softcap * tanh(score / softcap). Returns [T, Hq, D] f32; each
    query's result is bit-identical however the queries are batched.

    kv_dtype != "fp32": the caches hold that format (see KV_FORMATS; int4's
    last dim is D / 2) and k_scales / v_scales its scale pools
    ([num_blocks, block_size, Hkv] for fp8_e4m3 / int8, [..., Hkv, D / 32, 2]
    for int4). Rows are dequantized while read; the result is bit-identical
    to the fp32 kernel over kv_dequantize(cache) (still batch invariant).
    """
    if kv_dtype == "fp8_e4m3":  # a float8_e4m3fn pool is read as its bytes
        if isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float8_e4m3fn:
            k_cache = k_cache.view(torch.uint8)
        if isinstance(v_cache, torch.Tensor) and v_cache.dtype == torch.float8_e4m3fn:
            v_cache = v_cache.view(torch.uint8)
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_ids, positions, kv_dtype, k_scales, v_scales)
    window = int(sliding_window or 0)
    cap = float(softcap or 0.0)
    if window < 0 or cap < 0.0:
        raise ValueError("paged_attention: sliding_window and softcap must be >= 0")
    out = torch.empty(q.shape, dtype=torch.float32)  # [T, Hq, D]
    if q.shape[0] == 0:
        return out
    lib = _select(impl)
    if lib is not None:
        _c_attention(lib, q, k_cache, v_cache, block_tables, seq_ids, positions, float(scale), window, cap,
                     kv_dtype, k_scales, v_scales, out)
    else:
        _torch_attention(q, k_cache, v_cache, block_tables, seq_ids, positions, float(scale), window, cap,
                         kv_dtype, k_scales, v_scales, out)
    return out


def _check_attention_args(q, k_cache, v_cache, block_tables, seq_ids, positions, kv_dtype, k_scales,
                          v_scales) -> None:
    """paged_attention's argument checks: a ValueError naming the argument, before any kernel runs."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 3):
        raise ValueError("paged_attention: q must be a [T, Hq, D] tensor")
    T, Hq, D = q.shape
    _, store = _kv_format(kv_dtype)
    for name, t, dt in (("q", q, torch.float32), ("k_cache", k_cache, store), ("v_cache", v_cache, store)):
        if not (isinstance(t, torch.Tensor) and t.dtype == dt and t.is_contiguous()
                and t.device.type == "cpu"):
            raise ValueError(f"paged_attention: {name} must be a contiguous {str(dt).removeprefix('torch.')} "
                             f"CPU tensor")
    if k_cache.dim() != 4:
        raise ValueError(f"paged_attention: k_cache must be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError("paged_attention: v_cache must have the shape of k_cache")
    NB, BS, Hkv, Dk = k_cache.shape
    if (Dk * 2 if kv_dtype == "int4" else Dk) != D:
        raise ValueError(f"paged_attention: head dim of q ({D}) != cache ({Dk})")
    if not (Hkv > 0 and Hq % Hkv == 0):
        raise ValueError(f"paged_attention: Hq={Hq} must be a multiple of Hkv={Hkv}")
    sshape = kv_scale_shape(kv_dtype, D)
    if sshape is not None:
        want = (NB, BS, Hkv, *sshape)
        for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == want
                    and t.is_contiguous() and t.device.type == "cpu"):
                raise ValueError(f"paged_attention: {kv_dtype} needs {name}, a contiguous float32 CPU tensor "
                                 f"of shape {want}")
    if not (isinstance(block_tables, torch.Tensor) and block_tables.dtype == torch.int32
            and block_tables.dim() == 2 and block_tables.is_contiguous()):
        raise ValueError("paged_attention: block_tables must be a contiguous int32 [S, max_blocks] tensor")
    _check_i32_1d(seq_ids, "seq_ids", T)
    _check_i32_1d(positions, "positions", T)
    if D > 1024:
        raise ValueError("paged_attention: head dim > 1024 not supported")


def _c_attention(lib, q, k_cache, v_cache, block_tables, seq_ids, positions, scale: float, window: int, cap: float,
                 kv_dtype: str, k_scales, v_scales, out: torch.Tensor) -> None:
    """The C kernels into out [T, Hq, D] (checked arguments)."""
    T, Hq, D = q.shape
    NB, BS, Hkv, _ = k_cache.shape
    S, MAXB = block_tables.shape
    fmt, _ = _kv_format(kv_dtype)
    if fmt == 0:
        rc = lib.ss_paged_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), NB, BS, Hkv,
                                    block_tables.data_ptr(), S, MAXB, seq_ids.data_ptr(), positions.data_ptr(),
                                    T, Hq, D, scale, window, cap, out.data_ptr(), get_num_threads())
    else:
        scaled = kv_scale_shape(kv_dtype, D) is not None
        rc = lib.ss_paged_attention_kv(fmt, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                       k_scales.data_ptr() if scaled else None,
                                       v_scales.data_ptr() if scaled else None,
                                       kv_c_group(kv_dtype, D),
                                       NB, BS, Hkv, block_tables.data_ptr(), S, MAXB, seq_ids.data_ptr(),
                                       positions.data_ptr(), T, Hq, D, scale, window, cap,
                                       out.data_ptr(), get_num_threads())
    _check(rc, "paged_attention")


def _torch_attention(q, k_cache, v_cache, block_tables, seq_ids, positions, scale: float, window: int, cap: float,
                     kv_dtype: str, k_scales, v_scales, out: torch.Tensor) -> None:
    """The torch fallback into out [T, Hq, D]: one query per torch call (batch invariant by construction)."""
    T, Hq, D = q.shape
    NB, BS, Hkv, _ = k_cache.shape
    S, MAXB = block_tables.shape
    fmt, _ = _kv_format(kv_dtype)
    scaled = kv_scale_shape(kv_dtype, D) is not None
    group = Hq // Hkv
    sid = seq_ids.tolist()
    pos_l = positions.tolist()
    with torch.no_grad():
        for t in range(T):
            s, pos = sid[t], pos_l[t]
            if not 0 <= s < S:
                raise IndexError(f"paged_attention: seq id {s} out of range of block_tables")
            if pos < 0 or pos // BS >= MAXB:
                raise IndexError(f"paged_attention: position {pos} beyond the block table")
            start = max(0, pos - window + 1) if window > 0 else 0
            p = torch.arange(start, pos + 1)
            blocks = block_tables[s].long()[p // BS]
            if bool((blocks < 0).any()) or bool((blocks >= NB).any()):
                raise IndexError("paged_attention: block table entry out of range of the kv cache")
            offs = p % BS
            k = k_cache[blocks, offs]  # [L, Hkv, D]
            v = v_cache[blocks, offs]
            if fmt != 0:
                k = kv_dequantize(k, k_scales[blocks, offs] if scaled else None, kv_dtype)
                v = kv_dequantize(v, v_scales[blocks, offs] if scaled else None, kv_dtype)
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[t], k) * scale
            if cap > 0.0:
                scores = torch.tanh(scores / cap) * cap
            probs = torch.softmax(scores, dim=-1)
            out[t] = torch.einsum("hl,lhd->hd", probs, v)
