/*
 * specserve CPU kernels: batch-invariant linear / paged attention / RMSNorm.
 *
 * Invariance contract
 * -------------------
 * Every output element is computed by exactly one thread, with a reduction
 * order that depends only on the sizes of the reduced dimension (K, D, the
 * key count), never on the number of rows in the call, the tiling or the
 * thread count:
 *
 *   linear:   out[m][n] = hsum16(lane[0..15]) (* scale[n]) (+ bias[n]) where
 *             lane[l] accumulates x[m][k] * w[n][k] for k = l, l+16, l+32,
 *             ... in increasing k with a fused multiply-add, from +0.
 *             hsum16(a) = hsum8(a[l] + a[l+8]) and
 *             hsum8(a) = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
 *             (AVX-512: one zmm per output; AVX2: two ymm chains.)
 *   attention: scores in key-position order, two passes (max, then exp/sum
 *             and V accumulation in key order), dot products on 8 lanes
 *             + hsum8.
 *   rms_norm: sum of squares on 8 lanes + hsum8.
 *
 * The SIMD paths (AVX-512 / AVX2 + FMA) and the scalar path (fmaf on lanes)
 * implement exactly the same arithmetic, so the AVX-512, AVX2 and scalar
 * builds of this file give bit-identical results (tests check this).
 *
 * ss_linear: quantized weights are dequantized to fp32 with the same
 * operation order as gguf-py's reference dequantizers -- in registers for few
 * rows (decode), or into a small L1-resident tile shared by all rows of the
 * call -- and then multiplied with fp32 activations. Int8 weights: the
 * per-channel scale multiplies the finished sum.
 *
 * ss_linear_q8 (linear_q8.h, included at the end of this file): the
 * activations are quantized to int8 per block and multiplied with the weight
 * blocks in exact integer arithmetic (llama.cpp's scheme), the weights in the
 * panel layout of panel_pack.c; it has its own, equally fixed, order per
 * output (linear_panel.h).
 *
 * Build: see specserve/kernels/build.py.  Must be compiled with
 * -ffp-contract=off so that mul+add pairs are never silently fused.
 */
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(SS_FORCE_SCALAR)
#define SS_AVX2 1
#include <immintrin.h>
#endif

/* AVX-512 variants of some loops; the arithmetic (16-lane accumulators,
   elementwise dequantization) is the same as on AVX2 */
#if defined(SS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && !defined(SS_NO_AVX512)
#define SS_AVX512 1
#endif

#if defined(__F16C__) && !defined(SS_FORCE_SCALAR)
#define SS_F16C 1
#include <immintrin.h>
#endif

#define SS_EXPORT __attribute__((visibility("default")))
#define SS_ALIGN __attribute__((aligned(64)))
#define SS_INLINE static inline __attribute__((always_inline))

#define SS_ABI_VERSION 6

/* weight formats (keep in sync with ops.py) */
enum {
    FMT_F32 = 0,
    FMT_I8 = 1,   /* int8 [N,K] + per-row fp32 scale applied after the reduction */
    FMT_Q8_0 = 2,
    FMT_Q4_0 = 3,
    FMT_Q4_1 = 4,
    FMT_Q4_K = 5,
    FMT_Q6_K = 6,
    FMT_Q5_0 = 7, /* Q5_0 / Q5_1 / Q5_K: dequantization only (ss_dequantize, and ss_linear's fp32 path) */
    FMT_Q5_1 = 8,
    FMT_Q5_K = 9,
};
/* or-ed into a format: the weight is in the panel layout (panel_pack.c) */
#define FMT_PANEL 0x100

/* error codes */
enum {
    SS_OK = 0,
    SS_EINVAL = -1,
    SS_EFORMAT = -2,
    SS_EBLOCK = -3,   /* block table entry out of range */
    SS_EPOS = -4,     /* position out of range for the block table */
    SS_ESEQ = -5,     /* seq id out of range */
    SS_ENOMEM = -6,
};

/* ------------------------------------------------------------------------ */
/* threads                                                                  */
/* ------------------------------------------------------------------------ */

SS_EXPORT void set_num_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
}

SS_EXPORT int ss_get_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

SS_EXPORT int ss_abi_version(void) { return SS_ABI_VERSION; }

SS_EXPORT int ss_has_avx2(void) {
#ifdef SS_AVX2
    return 1;
#else
    return 0;
#endif
}

SS_EXPORT int ss_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

SS_EXPORT int ss_has_f16c(void) {
#ifdef SS_F16C
    return 1;
#else
    return 0;
#endif
}

static int resolve_threads(int nthreads) {
#ifdef _OPENMP
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    return nthreads < 1 ? 1 : nthreads;
#else
    (void)nthreads;
    return 1;
#endif
}

/* ------------------------------------------------------------------------ */
/* scalar helpers                                                           */
/* ------------------------------------------------------------------------ */

static inline float half_to_float_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

SS_INLINE float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef SS_F16C
    return _cvtsh_ss(h);
#else
    return half_to_float_soft(h);
#endif
}

/* fixed horizontal sum of 8 lanes */
SS_INLINE float hsum8(const float *a) {
    float s0 = a[0] + a[4];
    float s1 = a[1] + a[5];
    float s2 = a[2] + a[6];
    float s3 = a[3] + a[7];
    float t0 = s0 + s2;
    float t1 = s1 + s3;
    return t0 + t1;
}

/* 8-lane dot product, fixed order (see header) */
SS_INLINE float dot8(const float *a, const float *b, int n) {
#ifdef SS_AVX2
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= n; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    if (k < n) {
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - k),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + k, mask), _mm256_maskload_ps(b + k, mask), acc);
    }
    float l[8] SS_ALIGN;
    _mm256_store_ps(l, acc);
    return hsum8(l);
#else
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < n; k++) l[k & 7] = fmaf(a[k], b[k], l[k & 7]);
    return hsum8(l);
#endif
}

#include "kv_dequant.c"
#include "linear_f32.c"
#include "kv_formats.c"
#include "attention_dots.c"
#include "attention.c"

/* ------------------------------------------------------------------------ */
/* RMSNorm                                                                  */
/* ------------------------------------------------------------------------ */

SS_INLINE void rms_row(const float *x, const float *w, float *o, int64_t K, float eps, int unit) {
    const float ss = dot8(x, x, (int)K);
    const float r = 1.0f / sqrtf(ss / (float)K + eps);
    int64_t k = 0;
#ifdef SS_AVX2
    __m256 vr = _mm256_set1_ps(r), one = _mm256_set1_ps(1.0f);
    for (; k + 8 <= K; k += 8) {
        __m256 wv = _mm256_loadu_ps(w + k);
        if (unit) wv = _mm256_add_ps(one, wv);
        _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vr), wv));
    }
#endif
    for (; k < K; k++) {
        float wv = unit ? 1.0f + w[k] : w[k];
        o[k] = (x[k] * r) * wv;
    }
}

/* Uniforms in (0, 1) for a seeded request's position noise (specserve/kernels/noise.py):
 * out[i] = (top 23 bits of splitmix64(key + (i + 1) * golden) + 0.5) / 2^23. A counter-based
 * generator: each element is a function of (key, i) alone, in exact integer arithmetic, so the
 * torch fallback computes the same bits. */
SS_EXPORT int ss_uniform_noise(uint64_t key, int64_t n, float *out) {
    if (n < 0) return SS_EINVAL;
    for (int64_t i = 0; i < n; i++) {
        uint64_t z = key + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        out[i] = ((float)(int32_t)(z >> 41) + 0.5f) * (1.0f / 8388608.0f);
    }
    return 0;
}

/* The index of a row's largest value, as torch.argmax: the first one of the largest; a NaN counts
 * as the largest (the first NaN). One vector pass for the maximum (and whether there is a NaN),
 * one for its first index. */
static int64_t argmax_row(const float *x, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#if defined(SS_AVX512)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    __mmask16 un = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mv = _mm512_max_ps(mv, v);
    }
    m = _mm512_reduce_max_ps(mv), nan = un != 0;
#elif defined(SS_AVX2)
    __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mv = _mm256_max_ps(mv, v);
    }
    float lane[8];
    _mm256_storeu_ps(lane, mv);
    for (int j = 0; j < 8; j++) m = lane[j] > m ? lane[j] : m;
    nan = _mm256_movemask_ps(un) != 0;
#endif
    for (; i < n; i++) {
        nan |= isnan(x[i]);
        m = x[i] > m ? x[i] : m;
    }
    i = 0;
    if (!nan) {
#if defined(SS_AVX512)
        const __m512 b = _mm512_set1_ps(m);
        for (; i + 16 <= n; i += 16) {
            const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), b, _CMP_EQ_OQ);
            if (eq) return i + __builtin_ctz(eq);
        }
#elif defined(SS_AVX2)
        const __m256 b = _mm256_set1_ps(m);
        for (; i + 8 <= n; i += 8) {
            const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
            if (eq) return i + __builtin_ctz(eq);
        }
#endif
    }
    for (; i < n; i++)
        if (nan ? isnan(x[i]) : x[i] == m) return i;
    return 0;
}

/* out[m] = argmax of row m of x [M, N] (row stride ldx) */
SS_EXPORT int ss_argmax_rows(const float *x, int64_t M, int64_t N, int64_t ldx, int64_t *out) {
    if (M < 0 || N <= 0 || ldx < N) return SS_EINVAL;
    for (int64_t m = 0; m < M; m++) out[m] = argmax_row(x + m * ldx, N);
    return SS_OK;
}

/* out = rmsnorm(x) * (w or 1 + w); rows of length K, strides ldx / ldo */
SS_EXPORT int ss_rms_norm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, float eps,
                          int unit_offset, float *out, int64_t ldo, int nthreads) {
    if (M < 0 || K <= 0 || K > 0x7fffffff || ldx < K || ldo < K) return SS_EINVAL;
    nthreads = resolve_threads(nthreads);
    const int par = nthreads > 1 && M > 1 && (double)M * (double)K > 32768.0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t m = 0; m < M; m++) rms_row(x + m * ldx, w, out + m * ldo, K, eps, unit_offset);
    return SS_OK;
}

/* h = x + residual; out = rmsnorm(h) * w'.  h written to h_out (may alias residual). */
SS_EXPORT int ss_add_rms_norm(const float *x, const float *residual, int64_t M, int64_t K,
                              const float *w, float eps, int unit_offset, float *h_out, float *out,
                              int nthreads) {
    if (M < 0 || K <= 0 || K > 0x7fffffff) return SS_EINVAL;
    nthreads = resolve_threads(nthreads);
    const int par = nthreads > 1 && M > 1 && (double)M * (double)K > 32768.0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        const float *rr = residual + m * K;
        float *hr = h_out + m * K;
        int64_t k = 0;
#ifdef SS_AVX2
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(hr + k, _mm256_add_ps(_mm256_loadu_ps(xr + k), _mm256_loadu_ps(rr + k)));
#endif
        for (; k < K; k++) hr[k] = xr[k] + rr[k];
        rms_row(hr, w, out + m * K, K, eps, unit_offset);
    }
    return SS_OK;
}

/* ------------------------------------------------------------------------ */
/* integer-dot linear (int8 activations)                                    */
/* ------------------------------------------------------------------------ */

#include "linear_q8.h"

/* ------------------------------------------------------------------------ */
/* decoder layers: rope, act_mul, a stack of layers in one call             */
/* ------------------------------------------------------------------------ */

#include "decoder.h"

/* ------------------------------------------------------------------------ */
/* Gated DeltaNet (hybrid models' linear-attention layers)                  */
/* ------------------------------------------------------------------------ */

#include "deltanet.c"
#include "moe.c" /* after deltanet.c: its sigmoid */
#include "hybrid.h" /* a stack of hybrid layers: after decoder.h and deltanet.c, whose kernels it chains */
