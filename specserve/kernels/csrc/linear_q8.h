/*
 * Integer-dot linear: ss_linear_q8 (included once by cpu_kernels.c, which
 * defines the formats, h2f, hsum8/hsum16 and hsum8x8 used here).
 *
 * The activations are quantized to int8 per row and block, the way
 * llama.cpp's Q8_0 / Q8_K do it, and each weight block is multiplied with
 * them in exact int32 arithmetic; the float work is a few fused multiply-adds
 * per 64 weights instead of one per weight.
 *
 * Activation blocks: 32 values for Q8_0, Q4_0, Q4_1 and I8; 256 for Q4_K
 * and Q6_K.  Per block, a = max |x_i| (exact), dx = a / 127,
 * q_i = rint(x_i * (1 / dx)) (round half to even, |q_i| <= 127).  A block
 * with a < 1e-30 gives dx = 0, q = 0; one holding Inf or NaN gives dx = NaN
 * (its outputs become NaN).  The error is |x_i - q_i dx| <= a / 254 per
 * value: the result equals the exact product of the weights with the
 * quantized activations up to float rounding (ops.quantize_activations is
 * the same quantizer in torch; the ops module docstring gives the measured
 * effect on real models).
 *
 * Arithmetic of one output (m, n), fixed by K alone (batch invariance):
 * 16 float lanes f[l] from +0; every integer below is exact int32.
 *
 *  32-value formats, per pair of blocks (b0 = 2p, b1 = 2p + 1), the 64
 *  values are laid out in "lane order": natural (b0 then b1) for Q8_0 and
 *  I8; for Q4_0 / Q4_1 [b0 0..15, b1 0..15, b0 16..31, b1 16..31] (the
 *  nibble order of the weights).  Lane l covers positions 4l .. 4l+3 and
 *  block B(l) = l / 8 (natural) or (l / 4) % 2 (nibble order).
 *    P[l] = sum of the 4 products w * q (w: Q8_0 / I8 bytes, Q4_0 nibble - 8,
 *           Q4_1 nibble)
 *    f[l] = fmaf((float)P[l], dw[B] * dx[B], f[l])    (I8: dx[B] alone)
 *    Q4_1: f[l] = fmaf(m[B], dx[B] * (float)S[l], f[l]), S[l] = sum of
 *          the 4 q of the lane
 *  When K / 32 is odd, the last block b0 updates only its own lanes.
 *
 *  256-value formats, per super-block (d, and for Q4_K dmin; dx of the
 *  activation block): I[l] = sum over the 4 chunks of 64 values of
 *  sc(k) * w[k] * q[k] for the 4 k of lane l in each chunk (k = 64g + 4l
 *  .. 64g + 4l + 3; sc: Q4_K's 6-bit scale per 32, Q6_K's int8 scale per
 *  16; w: Q4_K nibble, Q6_K 6-bit value - 32), then
 *    f[l] = fmaf(d * dx, (float)I[l], f[l])
 *    Q4_K, lanes i = 0..3: f[i] = fmaf(-(dmin * dx), (float)(mn[2i] *
 *          S[2i] + mn[2i+1] * S[2i+1]), f[i]), S[j] = sum of q over
 *          sub-block j of 32, mn the 6-bit mins.
 *
 *  out = hsum16(f) (* scale[n] for I8) (+ bias[n]).
 *
 * The AVX-512 (VNNI dpbusd / dpwssd, or maddubs + madd), AVX2 (AVX-VNNI,
 * or maddubs + madd) and scalar paths produce the same integers and do the
 * same float operations lane for lane, so all builds give bit-identical
 * results.
 */

#define QL_MS 64 /* rows per super tile */
#ifndef QL_PF_BYTES
#define QL_PF_BYTES 8192 /* prefetch distance (rounded up to whole channel blocks) */
#endif
#ifndef QL_PF_HINT
#define QL_PF_HINT 3
#endif

/* ------------------------------------------------------------------------ */
/* activation quantization                                                  */
/* ------------------------------------------------------------------------ */

#define QL_AMIN 1e-30f

static int is_k_fmt(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q6_K; }
static int is_nibble_fmt(int fmt) { return fmt == FMT_Q4_0 || fmt == FMT_Q4_1; }

/* quantize n values (n % 32 == 0) in natural order; returns dx */
static float quant_block(const float *x, int n, int8_t *q) {
    uint32_t bits = 0;
    int i = 0;
#if defined(SS_AVX512)
    {
        __m512i mx = _mm512_setzero_si512();
        const __m512i am = _mm512_set1_epi32(0x7fffffff);
        for (; i < n; i += 16) mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512(x + i), am));
        bits = _mm512_reduce_max_epu32(mx);
    }
#elif defined(SS_AVX2)
    {
        __m256i mx = _mm256_setzero_si256();
        const __m256i am = _mm256_set1_epi32(0x7fffffff);
        for (; i < n; i += 8) mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), am));
        __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
        m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(1, 0, 3, 2)));
        m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(2, 3, 0, 1)));
        bits = (uint32_t)_mm_cvtsi128_si32(m4);
    }
#endif
    for (; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        b &= 0x7fffffffu;
        bits = b > bits ? b : bits;
    }
    if (bits >= 0x7f800000u) { /* Inf or NaN */
        memset(q, 0, (size_t)n);
        return NAN;
    }
    float amax;
    memcpy(&amax, &bits, 4);
    if (!(amax >= QL_AMIN)) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    const float d = amax / 127.0f, id = 1.0f / d;
    i = 0;
#if defined(SS_AVX512)
    const __m512 vid = _mm512_set1_ps(id);
    for (; i < n; i += 16)
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vid))));
#elif defined(SS_AVX2)
    const __m256 vid = _mm256_set1_ps(id);
    for (; i < n; i += 32) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vid));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vid));
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vid));
        __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vid));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i), p);
    }
#endif
    for (; i < n; i++) q[i] = (int8_t)lrintf(x[i] * id);
    return d;
}

/* Per-row record of the quantized activations (offsets in bytes, each a
   multiple of 64):
     q     int8 [nstep * 64]   lane order (see the header), zero padded
     32-value formats: dxv  float [nstep * 16]  dx of each lane's block
                       sxv  float [nstep * 16]  dx * S[l] (Q4_1), or
                       xc   int32 [nstep * 16]  -8 S[l] (Q4_0), -128 S[l]
                                                (Q8_0, I8): the start value
                                                of the lane's integer sum
                                                when the weights are biased
                                                to unsigned bytes
     256-value formats: dxv float [K / 256 * 16] dx of each super-block, x16
                        bs  int16 [K / 32]   sums of q per 32 (Q4_K)
                        p32 int16 [K / 2]    32 * (q[2i] + q[2i+1]) (Q6_K) */
typedef struct {
    int64_t stride, o_f1, o_f2, o_bs, o_p32;
    int64_t nstep; /* pairs of 32-blocks (the last may be half) or super-blocks */
} QXLay;

static int64_t al64(int64_t n) { return (n + 63) / 64 * 64; }

static void qx_layout(int fmt, int64_t K, QXLay *L) {
    memset(L, 0, sizeof(*L));
    if (is_k_fmt(fmt)) {
        L->nstep = K / 256;
        L->o_f1 = al64(K);
        L->o_bs = L->o_f1 + 64 * (K / 256);
        L->o_p32 = L->o_bs + (fmt == FMT_Q4_K ? al64(2 * (K / 32)) : 0);
        L->stride = L->o_p32 + (fmt == FMT_Q6_K ? al64(K) : 0);
    } else {
        L->nstep = (K / 32 + 1) / 2;
        L->o_f1 = L->nstep * 64;
        L->o_f2 = L->o_f1 + L->nstep * 64;
        L->stride = L->o_f2 + L->nstep * 64;
    }
}

static void qx_row(int fmt, const float *x, int64_t K, uint8_t *rec, const QXLay *L) {
    int8_t *q = (int8_t *)rec;
    if (is_k_fmt(fmt)) {
        float *dxv = (float *)(rec + L->o_f1);
        for (int64_t s = 0; s < L->nstep; s++) {
            const float dx = quant_block(x + 256 * s, 256, q + 256 * s);
            for (int l = 0; l < 16; l++) dxv[16 * s + l] = dx;
        }
        if (fmt == FMT_Q4_K) {
            int16_t *bs = (int16_t *)(rec + L->o_bs);
            for (int64_t j = 0; j < K / 32; j++) {
                int s = 0;
                for (int i = 0; i < 32; i++) s += q[32 * j + i];
                bs[j] = (int16_t)s;
            }
        } else {
            int16_t *p = (int16_t *)(rec + L->o_p32);
            for (int64_t i = 0; i < K / 2; i++) p[i] = (int16_t)(32 * (q[2 * i] + q[2 * i + 1]));
        }
        return;
    }
    const int64_t nb = K / 32;
    const int nib = is_nibble_fmt(fmt);
    float *dxv = (float *)(rec + L->o_f1), *sxv = (float *)(rec + L->o_f2);
    for (int64_t p = 0; p < L->nstep; p++) {
        int8_t t[64] SS_ALIGN;
        float d[2];
        d[0] = quant_block(x + 64 * p, 32, t);
        if (2 * p + 1 < nb) {
            d[1] = quant_block(x + 64 * p + 32, 32, t + 32);
        } else {
            d[1] = 0.0f;
            memset(t + 32, 0, 32);
        }
        int8_t *o = q + 64 * p;
        if (nib) {
            memcpy(o, t, 16);
            memcpy(o + 16, t + 32, 16);
            memcpy(o + 32, t + 16, 16);
            memcpy(o + 48, t + 48, 16);
        } else {
            memcpy(o, t, 64);
        }
        for (int l = 0; l < 16; l++) {
            const int b = nib ? (l >> 2) & 1 : l >> 3;
            const int s = o[4 * l] + o[4 * l + 1] + o[4 * l + 2] + o[4 * l + 3];
            dxv[16 * p + l] = d[b];
            if (fmt == FMT_Q4_1) sxv[16 * p + l] = d[b] * (float)s;
            else ((int32_t *)sxv)[16 * p + l] = (fmt == FMT_Q4_0 ? -8 : -128) * s;
        }
    }
}

/* Quantize rows as the kernel does, in natural order (for tests):
   q [M, K], d [M, K / block]; block = 256 for Q4_K / Q6_K, else 32. */
SS_EXPORT int ss_quantize_act(int fmt, const float *x, int64_t M, int64_t K, int64_t ldx, int8_t *q, float *d) {
    const int bk = is_k_fmt(fmt) ? 256 : 32;
    if (M < 0 || K <= 0 || K % bk != 0 || ldx < K) return SS_EINVAL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / bk; b++)
            d[m * (K / bk) + b] = quant_block(x + m * ldx + b * bk, bk, q + m * K + b * bk);
    return SS_OK;
}

/* ------------------------------------------------------------------------ */
/* 64-value vectors: one zmm (AVX-512) or two ymm (AVX2)                    */
/* ------------------------------------------------------------------------ */

#define QL_I8_256(a, b) _mm256_setr_epi32(a, a, a, a, b, b, b, b)

#if defined(SS_AVX512)
typedef __m512i vi16;
typedef __m512 vf16;
#ifndef QL_R
#define QL_R 4 /* rows per micro tile (4 x 4 measured best on Zen 5) */
#endif
#ifndef QL_C
#define QL_C 4 /* channels per micro tile */
#endif
SS_INLINE vi16 vi_from2(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
SS_INLINE vi16 vi_load(const void *p) { return _mm512_loadu_si512(p); }
SS_INLINE vi16 vi_zero(void) { return _mm512_setzero_si512(); }
SS_INLINE vf16 vf_zero(void) { return _mm512_setzero_ps(); }
SS_INLINE vf16 vf_load(const float *p) { return _mm512_loadu_ps(p); }
SS_INLINE void vf_store(float *p, vf16 a) { _mm512_storeu_ps(p, a); }
SS_INLINE vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
SS_INLINE vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }
SS_INLINE vf16 vf_cvt(vi16 a) { return _mm512_cvtepi32_ps(a); }
SS_INLINE vf16 vf_set1(float a) { return _mm512_set1_ps(a); }
/* lanes whose bit is set in mask from b, others from a */
SS_INLINE vf16 vf_blend(const int mask, vf16 a, vf16 b) { return _mm512_mask_blend_ps((__mmask16)mask, a, b); }
/* lanes 0..3: f - s * v */
SS_INLINE vf16 vf_fnmadd_lo4(__m128 v, vf16 s, vf16 f) {
    return _mm512_mask3_fnmadd_ps(_mm512_castps128_ps512(v), s, f, (__mmask16)0x000F);
}
/* int32 lane l += sum of u[4l+i] * s[4l+i], u unsigned and s signed bytes */
SS_INLINE vi16 vi_dot4(vi16 acc, vi16 u, vi16 s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
/* int16 lanes: u[2k] * s[2k] + u[2k+1] * s[2k+1] (never saturates here) */
SS_INLINE vi16 vi_maddubs(vi16 u, vi16 s) { return _mm512_maddubs_epi16(u, s); }
SS_INLINE vi16 vi_sub16(vi16 a, vi16 b) { return _mm512_sub_epi16(a, b); }
/* int32 lane l += a[2l] * b[2l] + a[2l+1] * b[2l+1] (int16 lanes) */
SS_INLINE vi16 vi_dot2(vi16 acc, vi16 a, vi16 b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
SS_INLINE vi16 vi_abs8(vi16 a) { return _mm512_abs_epi8(a); }
/* x with the sign of w (x where w >= 0: w == 0 contributes 0 anyway) */
SS_INLINE vi16 vi_sign8(vi16 x, vi16 w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
SS_INLINE vi16 vi_sub8(vi16 a, int v) { return _mm512_sub_epi8(a, _mm512_set1_epi8((char)v)); }
/* 4 floats -> 16 lanes: lane l gets v[idx[l]] */
SS_INLINE vf16 vf_perm4(__m128 v, __m512i idx) { return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v)); }
#define QL_IDX_NIB_D _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2)
#define QL_IDX_NIB_M _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3)
#define QL_IDX_NAT_D _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
#define QL_IDX_ALL(i) _mm512_set1_epi32(i)

#elif defined(SS_AVX2)
typedef struct { __m256i lo, hi; } vi16;
typedef struct { __m256 lo, hi; } vf16;
#ifndef QL_R
#define QL_R 4 /* (measured on Zen 5 with AVX-512 off: 4 x 1 beats 2 x 2, 4 x 2, 8 x 1) */
#endif
#ifndef QL_C
#define QL_C 1
#endif
SS_INLINE vi16 vi_from2(__m256i lo, __m256i hi) { vi16 r = {lo, hi}; return r; }
SS_INLINE vi16 vi_load(const void *p) {
    return vi_from2(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
SS_INLINE vi16 vi_zero(void) { return vi_from2(_mm256_setzero_si256(), _mm256_setzero_si256()); }
SS_INLINE vf16 vf_from2(__m256 lo, __m256 hi) { vf16 r = {lo, hi}; return r; }
SS_INLINE vf16 vf_zero(void) { return vf_from2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
SS_INLINE vf16 vf_load(const float *p) { return vf_from2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
SS_INLINE void vf_store(float *p, vf16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
SS_INLINE vf16 vf_mul(vf16 a, vf16 b) { return vf_from2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
SS_INLINE vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) {
    return vf_from2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
SS_INLINE vf16 vf_cvt(vi16 a) { return vf_from2(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
SS_INLINE vf16 vf_set1(float a) { return vf_from2(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
SS_INLINE vf16 vf_blend(const int mask, vf16 a, vf16 b) {
    /* the masks used: 0x00FF and 0x0F0F */
    if (mask == 0x00FF) return vf_from2(b.lo, a.hi);
    return vf_from2(_mm256_blend_ps(a.lo, b.lo, 0x0F), _mm256_blend_ps(a.hi, b.hi, 0x0F));
}
SS_INLINE vf16 vf_fnmadd_lo4(__m128 v, vf16 s, vf16 f) {
    const __m128 r = _mm_fnmadd_ps(v, _mm256_castps256_ps128(s.lo), _mm256_castps256_ps128(f.lo));
    return vf_from2(_mm256_insertf128_ps(f.lo, r, 0), f.hi);
}
SS_INLINE __m256i dot4_256(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
SS_INLINE vi16 vi_dot4(vi16 acc, vi16 u, vi16 s) {
    return vi_from2(dot4_256(acc.lo, u.lo, s.lo), dot4_256(acc.hi, u.hi, s.hi));
}
SS_INLINE vi16 vi_maddubs(vi16 u, vi16 s) {
    return vi_from2(_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi));
}
SS_INLINE vi16 vi_sub16(vi16 a, vi16 b) { return vi_from2(_mm256_sub_epi16(a.lo, b.lo), _mm256_sub_epi16(a.hi, b.hi)); }
SS_INLINE __m256i dot2_256(__m256i acc, __m256i a, __m256i b) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
SS_INLINE vi16 vi_dot2(vi16 acc, vi16 a, vi16 b) {
    return vi_from2(dot2_256(acc.lo, a.lo, b.lo), dot2_256(acc.hi, a.hi, b.hi));
}
SS_INLINE vi16 vi_abs8(vi16 a) { return vi_from2(_mm256_abs_epi8(a.lo), _mm256_abs_epi8(a.hi)); }
SS_INLINE vi16 vi_sign8(vi16 x, vi16 w) { return vi_from2(_mm256_sign_epi8(x.lo, w.lo), _mm256_sign_epi8(x.hi, w.hi)); }
SS_INLINE vi16 vi_sub8(vi16 a, int v) {
    const __m256i c = _mm256_set1_epi8((char)v);
    return vi_from2(_mm256_sub_epi8(a.lo, c), _mm256_sub_epi8(a.hi, c));
}
/* idx: two 8-lane index vectors (lanes 0..7, 8..15) */
typedef struct { __m256i lo, hi; } ql_idx;
SS_INLINE vf16 vf_perm4(__m128 v, ql_idx idx) {
    const __m256 w = _mm256_castps128_ps256(v);
    return vf_from2(_mm256_permutevar8x32_ps(w, idx.lo), _mm256_permutevar8x32_ps(w, idx.hi));
}
#define QL_IDX_NIB_D ((ql_idx){QL_I8_256(0, 2), QL_I8_256(0, 2)})
#define QL_IDX_NIB_M ((ql_idx){QL_I8_256(1, 3), QL_I8_256(1, 3)})
#define QL_IDX_NAT_D ((ql_idx){QL_I8_256(0, 0), QL_I8_256(2, 2)})
#define QL_IDX_ALL(i) ((ql_idx){_mm256_set1_epi32(i), _mm256_set1_epi32(i)})
#endif

#include "linear_q8_kernels.h"
