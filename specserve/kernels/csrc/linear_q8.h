/*
 * Integer-dot linear: ss_linear_q8 (included once by cpu_kernels.c, which
 * defines the formats and h2f used here).
 *
 * The activations are quantized to int8 per row and block, the way
 * llama.cpp's Q8_0 / Q8_K do it, and the weights -- kept in the panel
 * layout of panel_pack.c, 16 channels' blocks side by side -- are multiplied
 * with them in exact int32 arithmetic (linear_panel.h gives the arithmetic
 * of one output, fixed by K alone); the float work is a fused multiply-add or
 * two per weight block.
 *
 * Activation blocks: 32 values for I8, Q8_0, Q4_0 and Q4_1; 256 for Q4_K
 * and Q6_K.  Per block, a = max |x_i| (exact), dx = a / 127,
 * q_i = rint(x_i * (1 / dx)) (round half to even, |q_i| <= 127).  A block
 * with a < 1e-30 gives dx = 0, q = 0; one holding Inf or NaN gives dx = NaN
 * (its outputs become NaN).  The error is |x_i - q_i dx| <= a / 254 per
 * value: the result equals the exact product of the weights with the
 * quantized activations up to float rounding (ops.quantize_activations is
 * the same quantizer in torch; the ops module docstring gives the measured
 * effect on real models).
 *
 * The AVX-512 (VNNI dpbusd, or maddubs + madd), AVX2 (AVX-VNNI, or maddubs
 * + madd) and scalar paths produce the same integers and do the same float
 * operations per output, so all builds give bit-identical results.
 */

#define QL_AMIN 1e-30f

static int is_k_fmt(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q6_K; }
static int64_t al64(int64_t n) { return (n + 63) / 64 * 64; }

/* ------------------------------------------------------------------------ */
/* activation quantization                                                  */
/* ------------------------------------------------------------------------ */


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


#if defined(SS_AVX512)
typedef __m512i vi16;
typedef __m512 vf16;
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
/* lanes 0..3: f - s * v */
/* int32 lane l += sum of u[4l+i] * s[4l+i], u unsigned and s signed bytes */
SS_INLINE vi16 vi_dot4(vi16 acc, vi16 u, vi16 s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
/* int16 lanes: u[2k] * s[2k] + u[2k+1] * s[2k+1], u unsigned and s signed bytes (maddubs: the
   callers' bounds keep these and the int16 sums they add up from saturating) */
SS_INLINE vi16 vi_dot2(vi16 u, vi16 s) { return _mm512_maddubs_epi16(u, s); }
SS_INLINE vi16 vi_add16(vi16 a, vi16 b) { return _mm512_add_epi16(a, b); }
/* int32 lane l = a[2l] * b[2l] + a[2l+1] * b[2l+1] (int16 lanes) */
SS_INLINE vi16 vi_madd16(vi16 a, vi16 b) { return _mm512_madd_epi16(a, b); }
/* int32 lanes holding int16 values -> each value in both int16 halves of its lane */
SS_INLINE vi16 vi_dup16(vi16 a) { return _mm512_mask_blend_epi16(0xAAAAAAAAu, a, _mm512_slli_epi32(a, 16)); }
SS_INLINE vi16 vi_set16(int v) { return _mm512_set1_epi16((short)v); }
SS_INLINE vi16 vi_abs8(vi16 a) { return _mm512_abs_epi8(a); }
/* x with the sign of w (x where w >= 0: w == 0 contributes 0 anyway) */
SS_INLINE vi16 vi_sign8(vi16 x, vi16 w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
SS_INLINE vi16 vi_sub8(vi16 a, int v) { return _mm512_sub_epi8(a, _mm512_set1_epi8((char)v)); }
SS_INLINE vi16 vi_bcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
SS_INLINE vi16 vi_and(vi16 a, vi16 b) { return _mm512_and_si512(a, b); }
SS_INLINE void vi_store(void *p, vi16 a) { _mm512_storeu_si512(p, a); }
SS_INLINE vi16 vi_or(vi16 a, vi16 b) { return _mm512_or_si512(a, b); }
SS_INLINE vi16 vi_set8(int v) { return _mm512_set1_epi8((char)v); }
#define vi_srl16(a, n) _mm512_srli_epi16((a), (n))
#define vi_sll16(a, n) _mm512_slli_epi16((a), (n))
#define vi_sll32(a, n) _mm512_slli_epi32((a), (n))
SS_INLINE vi16 vi_add32(vi16 a, vi16 b) { return _mm512_add_epi32(a, b); }
SS_INLINE vi16 vi_mul32(vi16 a, vi16 b) { return _mm512_mullo_epi32(a, b); }
SS_INLINE vi16 vi_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
SS_INLINE vi16 vi_s8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
SS_INLINE vf16 vf_h16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
SS_INLINE vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }
/* per byte: (a & 0x0F) | (b & 0x30), as a bit select (a where m4) then a mask (m3f = 0x3F) */
SS_INLINE vi16 vi_nib_hi2(vi16 a, vi16 b, vi16 m4, vi16 m30) {
    (void)m30;
    return _mm512_and_si512(_mm512_ternarylogic_epi32(m4, a, b, 0xCA), _mm512_set1_epi8(0x3F));
}

/* 4 floats -> 16 lanes: lane l gets v[idx[l]] */

#elif defined(SS_AVX2)
typedef struct { __m256i lo, hi; } vi16;
typedef struct { __m256 lo, hi; } vf16;
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
SS_INLINE vi16 vi_dot2(vi16 u, vi16 s) { return vi_from2(_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi)); }
SS_INLINE vi16 vi_add16(vi16 a, vi16 b) { return vi_from2(_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)); }
SS_INLINE vi16 vi_madd16(vi16 a, vi16 b) { return vi_from2(_mm256_madd_epi16(a.lo, b.lo), _mm256_madd_epi16(a.hi, b.hi)); }
SS_INLINE vi16 vi_dup16(vi16 a) {
    return vi_from2(_mm256_blend_epi16(a.lo, _mm256_slli_epi32(a.lo, 16), 0xAA),
                    _mm256_blend_epi16(a.hi, _mm256_slli_epi32(a.hi, 16), 0xAA));
}
SS_INLINE vi16 vi_set16(int v) { const __m256i c = _mm256_set1_epi16((short)v); return vi_from2(c, c); }
SS_INLINE vi16 vi_abs8(vi16 a) { return vi_from2(_mm256_abs_epi8(a.lo), _mm256_abs_epi8(a.hi)); }
SS_INLINE vi16 vi_sign8(vi16 x, vi16 w) { return vi_from2(_mm256_sign_epi8(x.lo, w.lo), _mm256_sign_epi8(x.hi, w.hi)); }
SS_INLINE vi16 vi_sub8(vi16 a, int v) {
    const __m256i c = _mm256_set1_epi8((char)v);
    return vi_from2(_mm256_sub_epi8(a.lo, c), _mm256_sub_epi8(a.hi, c));
}
/* idx: two 8-lane index vectors (lanes 0..7, 8..15) */
SS_INLINE vi16 vi_bcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    const __m256i b = _mm256_set1_epi32(v);
    return vi_from2(b, b);
}
SS_INLINE vi16 vi_and(vi16 a, vi16 b) { return vi_from2(_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)); }
SS_INLINE void vi_store(void *p, vi16 a) {
    _mm256_storeu_si256((__m256i *)p, a.lo);
    _mm256_storeu_si256((__m256i *)p + 1, a.hi);
}
SS_INLINE vi16 vi_or(vi16 a, vi16 b) { return vi_from2(_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)); }
SS_INLINE vi16 vi_set8(int v) { const __m256i c = _mm256_set1_epi8((char)v); return vi_from2(c, c); }
#define vi_srl16(a, n) vi_from2(_mm256_srli_epi16((a).lo, (n)), _mm256_srli_epi16((a).hi, (n)))
#define vi_sll16(a, n) vi_from2(_mm256_slli_epi16((a).lo, (n)), _mm256_slli_epi16((a).hi, (n)))
#define vi_sll32(a, n) vi_from2(_mm256_slli_epi32((a).lo, (n)), _mm256_slli_epi32((a).hi, (n)))
SS_INLINE vi16 vi_add32(vi16 a, vi16 b) { return vi_from2(_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)); }
SS_INLINE vi16 vi_mul32(vi16 a, vi16 b) {
    return vi_from2(_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi));
}
SS_INLINE vi16 vi_u8(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return vi_from2(_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}
SS_INLINE vi16 vi_s8(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return vi_from2(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}
SS_INLINE vf16 vf_h16(const uint8_t *p) {
#ifdef SS_F16C
    return vf_from2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1)));
#else
    float t[16] SS_ALIGN;
    for (int i = 0; i < 16; i++) t[i] = h2f(p + 2 * i);
    return vf_load(t);
#endif
}
SS_INLINE vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) {
    return vf_from2(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
/* per byte: (a & 0x0F) | (b & 0x30) */
SS_INLINE vi16 vi_nib_hi2(vi16 a, vi16 b, vi16 m4, vi16 m30) { return vi_or(vi_and(a, m4), vi_and(b, m30)); }
#endif


#if defined(SS_AVX2)
/* with VNNI (no int16 saturation) signed weights are biased to unsigned
   bytes, w + 128, and the sums start from -128 S; without it the
   activations take the weights' signs (maddubs would saturate) */
#if (defined(SS_AVX512) && defined(__AVX512VNNI__)) || (!defined(SS_AVX512) && defined(__AVXVNNI__))
#define QL_U8BIAS 1
#endif
#endif

/* Without VNNI a 4-byte dot product is three instructions (maddubs, madd, add). The 4- and 6-bit
   formats' weights are unsigned and small, so the int16 pair sums of several chunks add up exactly
   in int16 lanes (|q| <= 127: Q4 8 chunks x 2 x 15 x 127 = 30480, Q6_K 2 chunks x 2 x 63 x 127 =
   32004, both < 32768), and one madd, with the sub-block's scales in both int16 halves of their
   lanes (K-quants) or with ones, gives their int32 sum: the same integers in about half the
   multiplies (linear_panel.h). -DQL_NO_I16ACC builds the per-chunk dot products instead. */
#if defined(SS_AVX2) && !defined(QL_U8BIAS) && !defined(QL_NO_I16ACC)
#define QL_I16ACC 1
#endif

/* the instructions of the integer dot products: 0 scalar, 1 AVX2 maddubs,
   2 AVX-VNNI (256-bit), 3 AVX-512 maddubs, 4 AVX-512 VNNI */
SS_EXPORT int ss_int_dot_isa(void) {
#if defined(SS_AVX512) && defined(__AVX512VNNI__)
    return 4;
#elif defined(SS_AVX512)
    return 3;
#elif defined(SS_AVX2) && defined(__AVXVNNI__)
    return 2;
#elif defined(SS_AVX2)
    return 1;
#else
    return 0;
#endif
}

#include "panel_pack.c"
#include "linear_panel.h"

/*
 * out[M, N] = x[M, K] @ W[N, K]^T (* scale) (+ bias), activations quantized
 * to int8 (see the top of this file). Same arguments as ss_linear; formats
 * I8 (K % 32 == 0), Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, each either in its plain
 * layout (packed here, per call) or or-ed with FMT_PANEL and packed by
 * ss_panel_pack (what ops.py passes).
 */
SS_EXPORT int ss_linear_q8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int fmt,
                           int64_t row_bytes, const float *scale, const float *bias, float *out, int64_t N,
                           int64_t ldo, int nthreads) {
    int be, bb;
    const int packed = (fmt & FMT_PANEL) != 0;
    fmt &= ~FMT_PANEL;
    if (!panel_fmt(fmt) || fmt_block(fmt, &be, &bb) != 0) return SS_EFORMAT;
    if (M < 0 || N < 0 || K <= 0 || ldx < K || ldo < N) return SS_EINVAL;
    if (K % panel_act_block(fmt) != 0 || row_bytes < (K / be) * bb) return SS_EINVAL;
    if (fmt == FMT_I8 && scale == NULL) return SS_EINVAL;
    if (M == 0 || N == 0) return SS_OK;
    nthreads = resolve_threads(nthreads);
    if (packed) return linear_panel(x, M, K, ldx, (const uint8_t *)w, fmt, scale, bias, out, N, ldo, nthreads);
    uint8_t *pw = (uint8_t *)aligned_alloc(64, (size_t)al64(ss_panel_bytes(fmt, N, K)));
    if (!pw) return SS_ENOMEM;
    int rc = ss_panel_pack(fmt, w, N, K, row_bytes, pw, nthreads);
    if (rc == SS_OK) rc = linear_panel(x, M, K, ldx, pw, fmt, scale, bias, out, N, ldo, nthreads);
    free(pw);
    return rc;
}

/* ss_linear_q8 over several weights at once (linear_panel_group): ng panel-packed weights of one
   format (FMT_PANEL set) and shape [N, K], weight g times its own rows xs[g] [Ms[g], K] into
   outs[g] [Ms[g], N] (rows contiguous; scales[g] for I8). Bit-identical to one call per weight. */
SS_EXPORT int ss_linear_q8_group(int ng, const float *const *xs, const int64_t *Ms, int64_t K, const void *const *ws,
                                 int fmt, const float *const *scales, float *const *outs, int64_t N, int nthreads) {
    int be, bb;
    if (!(fmt & FMT_PANEL)) return SS_EINVAL;
    fmt &= ~FMT_PANEL;
    if (!panel_fmt(fmt) || fmt_block(fmt, &be, &bb) != 0) return SS_EFORMAT;
    if (ng < 0 || N <= 0 || K <= 0 || K % panel_act_block(fmt) != 0) return SS_EINVAL;
    if (fmt == FMT_I8 && scales == NULL) return SS_EINVAL;
    for (int g = 0; g < ng; g++)
        if (Ms[g] < 0 || (Ms[g] > 0 && (!xs[g] || !ws[g] || !outs[g] || (fmt == FMT_I8 && !scales[g]))))
            return SS_EINVAL;
    if (ng == 0) return SS_OK;
    return linear_panel_group(ng, xs, Ms, K, (const uint8_t *const *)ws, fmt, scales, outs, N,
                              resolve_threads(nthreads));
}
