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
 * blocks in exact integer arithmetic (llama.cpp's scheme); it has its own,
 * equally fixed, reduction order (documented there).
 *
 * Build: see specserve/kernels/build.py.  Must be compiled with
 * -ffp-contract=off so that mul+add pairs are never silently fused.
 */
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

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

#define SS_ABI_VERSION 4

/* weight formats (keep in sync with ops.py) */
enum {
    FMT_F32 = 0,
    FMT_I8 = 1,   /* int8 [N,K] + per-row fp32 scale applied after the reduction */
    FMT_Q8_0 = 2,
    FMT_Q4_0 = 3,
    FMT_Q4_1 = 4,
    FMT_Q4_K = 5,
    FMT_Q6_K = 6,
};

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

/* ------------------------------------------------------------------------ */
/* dequantization of a chunk of one weight row                              */
/*   writes kc floats for elements [k0, k0+kc) of the row.                  */
/*   k0 and kc are multiples of the format's block size (except F32/I8).    */
/*   Arithmetic mirrors gguf-py's numpy dequantizers exactly.               */
/* ------------------------------------------------------------------------ */

static void deq_i8(const int8_t *q, int kc, float *out) {
    int k = 0;
#ifdef SS_AVX512
    for (; k + 16 <= kc; k += 16) {
        __m128i b = _mm_loadu_si128((const __m128i *)(q + k));
        _mm512_storeu_ps(out + k, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
    }
#endif
#ifdef SS_AVX2
    for (; k + 8 <= kc; k += 8) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(q + k));
        _mm256_storeu_ps(out + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
#endif
    for (; k < kc; k++) out[k] = (float)q[k];
}

static void deq_q8_0(const uint8_t *blk, int nblk, float *out) {
    for (int b = 0; b < nblk; b++, blk += 34, out += 32) {
        float d = h2f(blk);
        const int8_t *qs = (const int8_t *)(blk + 2);
#if defined(SS_AVX512)
        __m512 vd = _mm512_set1_ps(d);
        for (int g = 0; g < 2; g++) {
            __m128i b16 = _mm_loadu_si128((const __m128i *)(qs + 16 * g));
            _mm512_storeu_ps(out + 16 * g, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b16)), vd));
        }
#elif defined(SS_AVX2)
        __m256 vd = _mm256_set1_ps(d);
        for (int g = 0; g < 4; g++) {
            __m128i b8 = _mm_loadl_epi64((const __m128i *)(qs + 8 * g));
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
            _mm256_storeu_ps(out + 8 * g, _mm256_mul_ps(v, vd));
        }
#else
        for (int i = 0; i < 32; i++) out[i] = (float)qs[i] * d;
#endif
    }
}

#ifdef SS_AVX2
/* unpack 16 bytes of nibbles into 32 int32 lanes (4 x __m256i):
   low nibbles -> elements 0..15, high nibbles -> 16..31 */
SS_INLINE void unpack_nibbles32(const uint8_t *qs, __m256i v[4]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
    __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, m4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), m4);
    v[0] = _mm256_cvtepu8_epi32(lo);
    v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    v[2] = _mm256_cvtepu8_epi32(hi);
    v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}
#endif

static void deq_q4_0(const uint8_t *blk, int nblk, float *out) {
    for (int b = 0; b < nblk; b++, blk += 18, out += 32) {
        float d = h2f(blk);
        const uint8_t *qs = blk + 2;
#if defined(SS_AVX512)
        __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
        __m128i m4 = _mm_set1_epi8(0x0F);
        __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, m4));
        __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4));
        __m512 vd = _mm512_set1_ps(d);
        __m512i eight = _mm512_set1_epi32(8);
        _mm512_storeu_ps(out, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight))));
        _mm512_storeu_ps(out + 16, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight))));
#elif defined(SS_AVX2)
        __m256i v[4];
        unpack_nibbles32(qs, v);
        __m256 vd = _mm256_set1_ps(d);
        __m256i eight = _mm256_set1_epi32(8);
        for (int g = 0; g < 4; g++) {
            __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(v[g], eight));
            _mm256_storeu_ps(out + 8 * g, _mm256_mul_ps(vd, f));
        }
#else
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((int)(qs[i] & 0x0F) - 8);
            out[i + 16] = d * (float)((int)(qs[i] >> 4) - 8);
        }
#endif
    }
}

static void deq_q4_1(const uint8_t *blk, int nblk, float *out) {
    for (int b = 0; b < nblk; b++, blk += 20, out += 32) {
        float d = h2f(blk);
        float m = h2f(blk + 2);
        const uint8_t *qs = blk + 4;
#if defined(SS_AVX512)
        __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
        __m128i m4 = _mm_set1_epi8(0x0F);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, m4)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4)));
        __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(vd, lo), vm));
        _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_mul_ps(vd, hi), vm));
#elif defined(SS_AVX2)
        __m256i v[4];
        unpack_nibbles32(qs, v);
        __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        for (int g = 0; g < 4; g++) {
            __m256 f = _mm256_cvtepi32_ps(v[g]);
            _mm256_storeu_ps(out + 8 * g, _mm256_add_ps(_mm256_mul_ps(vd, f), vm));
        }
#else
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)(qs[i] & 0x0F) + m;
            out[i + 16] = d * (float)(qs[i] >> 4) + m;
        }
#endif
    }
}

static inline void q4k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K: 144 bytes per 256 elements: f16 d, f16 dmin, 12 bytes scales, 128 bytes qs */
static void deq_q4_k(const uint8_t *blk, int nblk, float *out) {
    for (int b = 0; b < nblk; b++, blk += 144, out += 256) {
        float d = h2f(blk);
        float dmin = h2f(blk + 2);
        const uint8_t *scales = blk + 4;
        const uint8_t *qs = blk + 16;
        for (int g = 0; g < 4; g++) {
            int sc1, m1i, sc2, m2i;
            q4k_scale_min(2 * g, scales, &sc1, &m1i);
            q4k_scale_min(2 * g + 1, scales, &sc2, &m2i);
            float d1 = d * (float)sc1, m1 = dmin * (float)m1i;
            float d2 = d * (float)sc2, m2 = dmin * (float)m2i;
            const uint8_t *q = qs + 32 * g;
            float *y = out + 64 * g;
#if defined(SS_AVX512)
            const __m512 vd1 = _mm512_set1_ps(d1), vm1 = _mm512_set1_ps(m1);
            const __m512 vd2 = _mm512_set1_ps(d2), vm2 = _mm512_set1_ps(m2);
            const __m128i m4 = _mm_set1_epi8(0x0F);
            for (int h = 0; h < 2; h++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * h));
                const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, m4)));
                const __m512 g2 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4)));
                _mm512_storeu_ps(y + 16 * h, _mm512_sub_ps(_mm512_mul_ps(vd1, f), vm1));
                _mm512_storeu_ps(y + 32 + 16 * h, _mm512_sub_ps(_mm512_mul_ps(vd2, g2), vm2));
            }
#elif defined(SS_AVX2)
            __m256 vd1 = _mm256_set1_ps(d1), vm1 = _mm256_set1_ps(m1);
            __m256 vd2 = _mm256_set1_ps(d2), vm2 = _mm256_set1_ps(m2);
            __m128i m4 = _mm_set1_epi8(0x0F);
            for (int h = 0; h < 2; h++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * h));
                __m128i lo = _mm_and_si128(bytes, m4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), m4);
                __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 g0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 g1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                _mm256_storeu_ps(y + 16 * h, _mm256_sub_ps(_mm256_mul_ps(vd1, f0), vm1));
                _mm256_storeu_ps(y + 16 * h + 8, _mm256_sub_ps(_mm256_mul_ps(vd1, f1), vm1));
                _mm256_storeu_ps(y + 32 + 16 * h, _mm256_sub_ps(_mm256_mul_ps(vd2, g0), vm2));
                _mm256_storeu_ps(y + 32 + 16 * h + 8, _mm256_sub_ps(_mm256_mul_ps(vd2, g1), vm2));
            }
#else
            for (int l = 0; l < 32; l++) {
                y[l] = d1 * (float)(q[l] & 0xF) - m1;
                y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
            }
#endif
        }
    }
}

/* Q6_K: 210 bytes per 256 elements: ql[128], qh[64], int8 scales[16], f16 d */
static void deq_q6_k(const uint8_t *blk, int nblk, float *out) {
    for (int b = 0; b < nblk; b++, blk += 210, out += 256) {
        const uint8_t *ql = blk;
        const uint8_t *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = h2f(blk + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *pl = ql + 64 * half;
            const uint8_t *ph = qh + 32 * half;
            const int8_t *ps = sc + 8 * half;
            float *y = out + 128 * half;
#if defined(SS_AVX512)
            const __m512i m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3), c32 = _mm512_set1_epi32(32);
            for (int l = 0; l < 32; l += 16) {
                const int is = l / 16;
                const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pl + l)));
                const __m512i bq = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pl + 32 + l)));
                const __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ph + l)));
                __m512i q1 = _mm512_or_si512(_mm512_and_si512(a, m15), _mm512_slli_epi32(_mm512_and_si512(hb, m3), 4));
                __m512i q2 = _mm512_or_si512(_mm512_and_si512(bq, m15),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 2), m3), 4));
                __m512i q3 = _mm512_or_si512(_mm512_srli_epi32(a, 4),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 4), m3), 4));
                __m512i q4 = _mm512_or_si512(_mm512_srli_epi32(bq, 4),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 6), m3), 4));
                _mm512_storeu_ps(y + l, _mm512_mul_ps(_mm512_set1_ps(d * (float)ps[is + 0]),
                                                      _mm512_cvtepi32_ps(_mm512_sub_epi32(q1, c32))));
                _mm512_storeu_ps(y + l + 32, _mm512_mul_ps(_mm512_set1_ps(d * (float)ps[is + 2]),
                                                           _mm512_cvtepi32_ps(_mm512_sub_epi32(q2, c32))));
                _mm512_storeu_ps(y + l + 64, _mm512_mul_ps(_mm512_set1_ps(d * (float)ps[is + 4]),
                                                           _mm512_cvtepi32_ps(_mm512_sub_epi32(q3, c32))));
                _mm512_storeu_ps(y + l + 96, _mm512_mul_ps(_mm512_set1_ps(d * (float)ps[is + 6]),
                                                           _mm512_cvtepi32_ps(_mm512_sub_epi32(q4, c32))));
            }
#elif defined(SS_AVX2)
            __m256i m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), c32 = _mm256_set1_epi32(32);
            for (int l = 0; l < 32; l += 8) {
                int is = l / 16;
                __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(pl + l)));
                __m256i bq = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(pl + 32 + l)));
                __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ph + l)));
                __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, m15),
                                             _mm256_slli_epi32(_mm256_and_si256(hb, m3), 4));
                __m256i q2 = _mm256_or_si256(_mm256_and_si256(bq, m15),
                                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 2), m3), 4));
                __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 4), m3), 4));
                __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(bq, 4),
                                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 6), m3), 4));
                q1 = _mm256_sub_epi32(q1, c32);
                q2 = _mm256_sub_epi32(q2, c32);
                q3 = _mm256_sub_epi32(q3, c32);
                q4 = _mm256_sub_epi32(q4, c32);
                _mm256_storeu_ps(y + l, _mm256_mul_ps(_mm256_set1_ps(d * (float)ps[is + 0]), _mm256_cvtepi32_ps(q1)));
                _mm256_storeu_ps(y + l + 32, _mm256_mul_ps(_mm256_set1_ps(d * (float)ps[is + 2]), _mm256_cvtepi32_ps(q2)));
                _mm256_storeu_ps(y + l + 64, _mm256_mul_ps(_mm256_set1_ps(d * (float)ps[is + 4]), _mm256_cvtepi32_ps(q3)));
                _mm256_storeu_ps(y + l + 96, _mm256_mul_ps(_mm256_set1_ps(d * (float)ps[is + 6]), _mm256_cvtepi32_ps(q4)));
            }
#else
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int)((pl[l] & 0xF) | (((ph[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int)((pl[l + 32] & 0xF) | (((ph[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((pl[l] >> 4) | (((ph[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((pl[l + 32] >> 4) | (((ph[l] >> 6) & 3) << 4)) - 32;
                y[l] = (d * (float)ps[is + 0]) * (float)q1;
                y[l + 32] = (d * (float)ps[is + 2]) * (float)q2;
                y[l + 64] = (d * (float)ps[is + 4]) * (float)q3;
                y[l + 96] = (d * (float)ps[is + 6]) * (float)q4;
            }
#endif
        }
    }
}

static int fmt_block(int fmt, int *block_elems, int *block_bytes) {
    switch (fmt) {
    case FMT_F32: *block_elems = 1; *block_bytes = 4; return 0;
    case FMT_I8: *block_elems = 1; *block_bytes = 1; return 0;
    case FMT_Q8_0: *block_elems = 32; *block_bytes = 34; return 0;
    case FMT_Q4_0: *block_elems = 32; *block_bytes = 18; return 0;
    case FMT_Q4_1: *block_elems = 32; *block_bytes = 20; return 0;
    case FMT_Q4_K: *block_elems = 256; *block_bytes = 144; return 0;
    case FMT_Q6_K: *block_elems = 256; *block_bytes = 210; return 0;
    default: return -1;
    }
}

/* dequantize elements [k0, k0+kc) of one row; k0 is a multiple of the block
   size and kc is a multiple of it unless the chunk ends the row. */
static void deq_chunk(int fmt, const uint8_t *row, int64_t k0, int kc, float *out) {
    switch (fmt) {
    case FMT_F32: memcpy(out, (const float *)row + k0, sizeof(float) * (size_t)kc); break;
    case FMT_I8: deq_i8((const int8_t *)row + k0, kc, out); break;
    case FMT_Q8_0: deq_q8_0(row + (k0 / 32) * 34, kc / 32, out); break;
    case FMT_Q4_0: deq_q4_0(row + (k0 / 32) * 18, kc / 32, out); break;
    case FMT_Q4_1: deq_q4_1(row + (k0 / 32) * 20, kc / 32, out); break;
    case FMT_Q4_K: deq_q4_k(row + (k0 / 256) * 144, kc / 256, out); break;
    case FMT_Q6_K: deq_q6_k(row + (k0 / 256) * 210, kc / 256, out); break;
    default: break;
    }
}

/* Dequantize a whole [N, K] matrix (scale of I8 not applied). */
SS_EXPORT int ss_dequantize(int fmt, const void *w, int64_t N, int64_t K, int64_t row_bytes,
                            float *out, int nthreads) {
    int be, bb;
    if (fmt_block(fmt, &be, &bb) != 0) return SS_EFORMAT;
    if (N < 0 || K < 0 || K % be != 0 || row_bytes < (K / be) * bb) return SS_EINVAL;
    nthreads = resolve_threads(nthreads);
    const uint8_t *wb = (const uint8_t *)w;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t k0 = 0; k0 < K; k0 += 4096) {
            int kc = (int)(K - k0 < 4096 ? K - k0 : 4096);
            deq_chunk(fmt, wb + n * row_bytes, k0, kc, out + n * K + k0);
        }
    }
    return SS_OK;
}

/* ------------------------------------------------------------------------ */
/* linear                                                                   */
/* ------------------------------------------------------------------------ */

#define LIN_NB 8    /* output channels per block (one thread owns a block) */
#ifndef LIN_KC
#define LIN_KC 1024 /* max K chunk dequantized at once (multiple of 256) */
#endif
#ifndef LIN_MS
#define LIN_MS 32   /* rows per super tile (accumulators kept in memory) */
#endif
#define LIN_L 16    /* accumulator lanes per output element */
#define LIN_ACCS (LIN_NB * LIN_L) /* floats of accumulators per row */

/* fixed reduction of the 16 lanes of one output */
SS_INLINE float hsum16(const float *a) {
    float s[8];
    for (int l = 0; l < 8; l++) s[l] = a[l] + a[l + 8];
    return hsum8(s);
}

#if defined(SS_AVX512)
/* One zmm per output element holds its 16 lanes.
   R rows x C channels; acc layout acc[r * LIN_ACCS + j * 16 + lane]. */
SS_INLINE void lin_micro(const int R, const int C, const float *x, int64_t ldx,
                         const float *const *wp, int kc, float *acc) {
    __m512 a[4][8];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) a[r][j] = _mm512_load_ps(acc + r * LIN_ACCS + j * 16);
    int k = 0;
    for (; k + 16 <= kc; k += 16) {
        __m512 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
        for (int j = 0; j < C; j++) {
            __m512 wv = _mm512_loadu_ps(wp[j] + k);
            for (int r = 0; r < R; r++) a[r][j] = _mm512_fmadd_ps(xv[r], wv, a[r][j]);
        }
    }
    if (k < kc) {
        const __mmask16 mask = (__mmask16)((1u << (kc - k)) - 1u);
        __m512 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * ldx + k);
        for (int j = 0; j < C; j++) {
            __m512 wv = _mm512_maskz_loadu_ps(mask, wp[j] + k);
            for (int r = 0; r < R; r++) a[r][j] = _mm512_fmadd_ps(xv[r], wv, a[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) _mm512_store_ps(acc + r * LIN_ACCS + j * 16, a[r][j]);
}

static void lin_chunk(const float *x, int64_t ldx, int ms, const float *const *wp, int kc, float *acc) {
    int m = 0;
    for (; m + 3 <= ms; m += 3) lin_micro(3, 8, x + m * ldx, ldx, wp, kc, acc + m * LIN_ACCS);
    if (m + 2 <= ms) {
        lin_micro(2, 8, x + m * ldx, ldx, wp, kc, acc + m * LIN_ACCS);
        m += 2;
    }
    if (m < ms) lin_micro(1, 8, x + m * ldx, ldx, wp, kc, acc + m * LIN_ACCS);
}

#elif defined(SS_AVX2)
/* Lanes 0..7 and 8..15 of an output are independent chains: run one pass
   per half (h = 0, 1) over the chunk, stepping 16 elements, with one ymm
   accumulator per (row, channel). */
SS_INLINE void lin_micro_half(const int R, const int C, const int h, const float *x, int64_t ldx,
                              const float *const *wp, int kc, float *acc) {
    __m256 a[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) a[r][j] = _mm256_load_ps(acc + r * LIN_ACCS + j * 16 + 8 * h);
    int k = 8 * h;
    for (; k + 8 <= kc; k += 16) {
        __m256 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
        for (int j = 0; j < C; j++) {
            __m256 wv = _mm256_loadu_ps(wp[j] + k);
            for (int r = 0; r < R; r++) a[r][j] = _mm256_fmadd_ps(xv[r], wv, a[r][j]);
        }
    }
    if (k < kc) {
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(kc - k),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm256_maskload_ps(x + r * ldx + k, mask);
        for (int j = 0; j < C; j++) {
            __m256 wv = _mm256_maskload_ps(wp[j] + k, mask);
            for (int r = 0; r < R; r++) a[r][j] = _mm256_fmadd_ps(xv[r], wv, a[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) _mm256_store_ps(acc + r * LIN_ACCS + j * 16 + 8 * h, a[r][j]);
}

SS_INLINE void lin_micro(const int R, const int C, const float *x, int64_t ldx,
                         const float *const *wp, int kc, float *acc) {
    lin_micro_half(R, C, 0, x, ldx, wp, kc, acc);
    lin_micro_half(R, C, 1, x, ldx, wp, kc, acc);
}

static void lin_chunk(const float *x, int64_t ldx, int ms, const float *const *wp, int kc, float *acc) {
    int m = 0;
    for (; m + 3 <= ms; m += 3) {
        lin_micro(3, 4, x + m * ldx, ldx, wp, kc, acc + m * LIN_ACCS);
        lin_micro(3, 4, x + m * ldx, ldx, wp + 4, kc, acc + m * LIN_ACCS + 64);
    }
    if (m + 2 <= ms) {
        lin_micro(2, 4, x + m * ldx, ldx, wp, kc, acc + m * LIN_ACCS);
        lin_micro(2, 4, x + m * ldx, ldx, wp + 4, kc, acc + m * LIN_ACCS + 64);
        m += 2;
    }
    if (m < ms) {
        lin_micro(1, 4, x + m * ldx, ldx, wp, kc, acc + m * LIN_ACCS);
        lin_micro(1, 4, x + m * ldx, ldx, wp + 4, kc, acc + m * LIN_ACCS + 64);
    }
}
#else  /* scalar mirror */
static void lin_chunk(const float *x, int64_t ldx, int ms, const float *const *wp, int kc, float *acc) {
    for (int m = 0; m < ms; m++) {
        const float *xr = x + m * ldx;
        for (int j = 0; j < LIN_NB; j++) {
            float *l = acc + m * LIN_ACCS + j * 16;
            const float *w = wp[j];
            for (int k = 0; k < kc; k++) l[k & 15] = fmaf(xr[k], w[k], l[k & 15]);
        }
    }
}
#endif


/* ---- fused dequantize + FMA for few rows (decode): the weights are
   converted in registers, no tile round trip. Same lane assignment and
   order as the tiled path: lane l gets k = l, l+16, l+32, ... in order. */
#if defined(SS_AVX512)
/* rows up to which the fused path beats the dequantized tile (measured on
   Zen 5): 8-bit formats convert cheaply, 4-bit ones less so */
#define LIN_FUSED_RMAX 8
#define LIN_FUSED_RMAX_Q4 4
SS_INLINE void deq32_v(const int fmt, const uint8_t *row, int64_t k, __m512 w[2]) {
    if (fmt == FMT_I8) {
        const int8_t *q = (const int8_t *)row + k;
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    } else if (fmt == FMT_Q8_0) {
        const uint8_t *blk = row + (k / 32) * 34;
        const __m512 vd = _mm512_set1_ps(h2f(blk));
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))), vd);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))), vd);
    } else if (fmt == FMT_Q4_0) {
        const uint8_t *blk = row + (k / 32) * 18;
        const __m512 vd = _mm512_set1_ps(h2f(blk));
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i m4 = _mm_set1_epi8(0x0F);
        const __m512i eight = _mm512_set1_epi32(8);
        __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, m4));
        __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4));
        w[0] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)));
        w[1] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)));
    } else { /* FMT_Q4_1 */
        const uint8_t *blk = row + (k / 32) * 20;
        const __m512 vd = _mm512_set1_ps(h2f(blk)), vm = _mm512_set1_ps(h2f(blk + 2));
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i m4 = _mm_set1_epi8(0x0F);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, m4)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4)));
        w[0] = _mm512_add_ps(_mm512_mul_ps(vd, lo), vm);
        w[1] = _mm512_add_ps(_mm512_mul_ps(vd, hi), vm);
    }
}

/* R rows x C channels over the whole K (K % 32 == 0); overwrites acc */
SS_INLINE void lin_fused_rc(const int fmt, const int R, const int C, const float *x, int64_t ldx,
                            const uint8_t *const *rows, int64_t K, float *acc) {
    __m512 a[4][8];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) a[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512 x0[4], x1[4];
        for (int r = 0; r < R; r++) {
            x0[r] = _mm512_loadu_ps(x + r * ldx + k);
            x1[r] = _mm512_loadu_ps(x + r * ldx + k + 16);
        }
        for (int j = 0; j < C; j++) {
            __m512 w[2];
            deq32_v(fmt, rows[j], k, w);
            for (int r = 0; r < R; r++) {
                a[r][j] = _mm512_fmadd_ps(x0[r], w[0], a[r][j]);
                a[r][j] = _mm512_fmadd_ps(x1[r], w[1], a[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) _mm512_store_ps(acc + r * LIN_ACCS + j * 16, a[r][j]);
}

/* rows [0, ms) of the super tile x all LIN_NB channels */
SS_INLINE void lin_fused(const int fmt, int ms, const float *x, int64_t ldx,
                         const uint8_t *const *rows, int64_t K, float *acc) {
    int m = 0;
    for (; m + 4 <= ms; m += 4) {
        lin_fused_rc(fmt, 4, 4, x + m * ldx, ldx, rows, K, acc + m * LIN_ACCS);
        lin_fused_rc(fmt, 4, 4, x + m * ldx, ldx, rows + 4, K, acc + m * LIN_ACCS + 64);
    }
    if (ms - m == 3) {
        lin_fused_rc(fmt, 3, 4, x + m * ldx, ldx, rows, K, acc + m * LIN_ACCS);
        lin_fused_rc(fmt, 3, 4, x + m * ldx, ldx, rows + 4, K, acc + m * LIN_ACCS + 64);
    } else if (ms - m == 2) {
        lin_fused_rc(fmt, 2, 8, x + m * ldx, ldx, rows, K, acc + m * LIN_ACCS);
    } else if (ms - m == 1) {
        lin_fused_rc(fmt, 1, 8, x + m * ldx, ldx, rows, K, acc + m * LIN_ACCS);
    }
}

#elif defined(SS_AVX2)
#ifndef LIN_FUSED_RMAX
#define LIN_FUSED_RMAX 8
#endif
#ifndef LIN_FUSED_RMAX_Q4
#define LIN_FUSED_RMAX_Q4 4
#endif
/* elements k..k+31 as 4 ymm: [0..7], [8..15], [16..23], [24..31] */
SS_INLINE void deq32_v(const int fmt, const uint8_t *row, int64_t k, __m256 w[4]) {
    if (fmt == FMT_I8 || fmt == FMT_Q8_0) {
        const int8_t *q;
        __m256 vd = _mm256_set1_ps(1.0f);
        if (fmt == FMT_I8) {
            q = (const int8_t *)row + k;
        } else {
            const uint8_t *blk = row + (k / 32) * 34;
            vd = _mm256_set1_ps(h2f(blk));
            q = (const int8_t *)(blk + 2);
        }
        for (int g = 0; g < 4; g++) {
            w[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * g))));
            if (fmt == FMT_Q8_0) w[g] = _mm256_mul_ps(w[g], vd);
        }
    } else if (fmt == FMT_Q4_0) {
        const uint8_t *blk = row + (k / 32) * 18;
        const __m256 vd = _mm256_set1_ps(h2f(blk));
        const __m256i eight = _mm256_set1_epi32(8);
        __m256i v[4];
        unpack_nibbles32(blk + 2, v);
        for (int g = 0; g < 4; g++) w[g] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_sub_epi32(v[g], eight)));
    } else { /* FMT_Q4_1 */
        const uint8_t *blk = row + (k / 32) * 20;
        const __m256 vd = _mm256_set1_ps(h2f(blk)), vm = _mm256_set1_ps(h2f(blk + 2));
        __m256i v[4];
        unpack_nibbles32(blk + 4, v);
        for (int g = 0; g < 4; g++) w[g] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(v[g])), vm);
    }
}

/* R rows x C channels over the whole K (K % 32 == 0): lanes 0..7 in lo,
   lanes 8..15 in hi; overwrites acc */
SS_INLINE void lin_fused_rc(const int fmt, const int R, const int C, const float *x, int64_t ldx,
                            const uint8_t *const *rows, int64_t K, float *acc) {
    __m256 lo[4][4], hi[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) lo[r][j] = hi[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        for (int j = 0; j < C; j++) {
            __m256 w[4];
            deq32_v(fmt, rows[j], k, w);
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * ldx + k;
                lo[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], lo[r][j]);
                hi[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], hi[r][j]);
                lo[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], lo[r][j]);
                hi[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], hi[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            _mm256_store_ps(acc + r * LIN_ACCS + j * 16, lo[r][j]);
            _mm256_store_ps(acc + r * LIN_ACCS + j * 16 + 8, hi[r][j]);
        }
}

SS_INLINE void lin_fused(const int fmt, int ms, const float *x, int64_t ldx,
                         const uint8_t *const *rows, int64_t K, float *acc) {
    int m = 0;
    for (; m + 4 <= ms; m += 4)
        for (int j = 0; j < LIN_NB; j++)
            lin_fused_rc(fmt, 4, 1, x + m * ldx, ldx, rows + j, K, acc + m * LIN_ACCS + j * 16);
    if (ms - m == 3) {
        for (int j = 0; j < LIN_NB; j++)
            lin_fused_rc(fmt, 3, 1, x + m * ldx, ldx, rows + j, K, acc + m * LIN_ACCS + j * 16);
    } else if (ms - m == 2) {
        for (int j = 0; j < LIN_NB; j += 2)
            lin_fused_rc(fmt, 2, 2, x + m * ldx, ldx, rows + j, K, acc + m * LIN_ACCS + j * 16);
    } else if (ms - m == 1) {
        lin_fused_rc(fmt, 1, 4, x + m * ldx, ldx, rows, K, acc + m * LIN_ACCS);
        lin_fused_rc(fmt, 1, 4, x + m * ldx, ldx, rows + 4, K, acc + m * LIN_ACCS + 64);
    }
}
#else
#define LIN_FUSED_RMAX 0
#define LIN_FUSED_RMAX_Q4 0
#endif

#if LIN_FUSED_RMAX > 0
static void lin_fused_dispatch(int fmt, int ms, const float *x, int64_t ldx, const uint8_t *const *rows,
                               int64_t K, float *acc) {
#define SS_FUSED_CASE(F)                          \
    case F:                                       \
        lin_fused(F, ms, x, ldx, rows, K, acc);   \
        break;
    switch (fmt) {
        SS_FUSED_CASE(FMT_I8)
        SS_FUSED_CASE(FMT_Q8_0)
        SS_FUSED_CASE(FMT_Q4_0)
        SS_FUSED_CASE(FMT_Q4_1)
    default: break;
    }
#undef SS_FUSED_CASE
}
#endif

/*
 * out[M, N] = x[M, K] @ W[N, K]^T (* scale) (+ bias)
 *   w: rows of row_bytes bytes in format fmt.
 *   scale: per-row scale for FMT_I8 (required), ignored otherwise.
 *   bias: optional (NULL).
 *   ldx / ldo: row strides (in floats) of x and out.
 */
SS_EXPORT int ss_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int fmt,
                        int64_t row_bytes, const float *scale, const float *bias, float *out,
                        int64_t N, int64_t ldo, int nthreads) {
    int be, bb;
    if (fmt_block(fmt, &be, &bb) != 0) return SS_EFORMAT;
    if (M < 0 || N < 0 || K <= 0 || ldx < K || ldo < N) return SS_EINVAL;
    if (K % be != 0 || row_bytes < (K / be) * bb) return SS_EINVAL;
    if (fmt == FMT_I8 && scale == NULL) return SS_EINVAL;
    if (M == 0 || N == 0) return SS_OK;
    nthreads = resolve_threads(nthreads);
    const uint8_t *wb = (const uint8_t *)w;
    const int64_t nblocks = (N + LIN_NB - 1) / LIN_NB;
    const double work = (double)M * (double)N * (double)K;
    const int par = nthreads > 1 && work > 200000.0 && nblocks > 1;
    /* row count up to which the fused (in-register dequantization) path is used */
    int fused = 0;
    if (K % 32 == 0) {
        if (fmt == FMT_I8 || fmt == FMT_Q8_0) fused = LIN_FUSED_RMAX;
        else if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) fused = LIN_FUSED_RMAX_Q4;
    }
    const int prefetch = N * row_bytes > (1 << 20);
    /* K chunk: K itself when it fits, else equal parts rounded up to 256 */
    int64_t kchunk = K;
    if (K > LIN_KC) {
        const int64_t parts = (K + LIN_KC - 1) / LIN_KC;
        kchunk = ((K + parts - 1) / parts + 255) / 256 * 256;
    }
    (void)fused;

#pragma omp parallel num_threads(nthreads) if (par)
    {
        float acc[LIN_MS * LIN_ACCS] SS_ALIGN;
        float wbuf[LIN_NB][LIN_KC] SS_ALIGN;
        for (int64_t m0 = 0; m0 < M; m0 += LIN_MS) {
            const int ms = (int)(M - m0 < LIN_MS ? M - m0 : LIN_MS);
#pragma omp for schedule(static) nowait
            for (int64_t blk = 0; blk < nblocks; blk++) {
                const int64_t n0 = blk * LIN_NB;
                const int nb = (int)(N - n0 < LIN_NB ? N - n0 : LIN_NB);
                memset(acc, 0, sizeof(float) * (size_t)ms * LIN_ACCS);
                if (prefetch && blk + 1 < nblocks) {
                    /* the next block's rows are contiguous: pull them in
                       while this block computes */
                    const uint8_t *p = wb + (n0 + LIN_NB) * row_bytes;
                    const uint8_t *pe = wb + (n0 + 2 * LIN_NB < N ? n0 + 2 * LIN_NB : N) * row_bytes;
                    for (; p < pe; p += 64) __builtin_prefetch(p, 0, 3);
                }
#if LIN_FUSED_RMAX > 0
                if (ms <= fused) {
                    const uint8_t *rows[LIN_NB];
                    for (int j = 0; j < LIN_NB; j++) rows[j] = wb + (n0 + (j < nb ? j : 0)) * row_bytes;
                    lin_fused_dispatch(fmt, ms, x + m0 * ldx, ldx, rows, K, acc);
                } else
#endif
                for (int64_t k0 = 0; k0 < K; k0 += kchunk) {
                    const int kc = (int)(K - k0 < kchunk ? K - k0 : kchunk);
                    const float *wp[LIN_NB];
                    for (int j = 0; j < LIN_NB; j++) {
                        /* channels past N reuse channel n0 (results discarded) */
                        const int64_t n = n0 + (j < nb ? j : 0);
                        const uint8_t *row = wb + n * row_bytes;
                        if (fmt == FMT_F32 && ms < 8) {
                            /* few rows: stream the weight rows directly; with
                               more rows a copy into the L1 tile is faster */
                            wp[j] = (const float *)row + k0;
                        } else {
                            if (j < nb || j == 0) deq_chunk(fmt, row, k0, kc, wbuf[j]);
                            wp[j] = (j < nb) ? wbuf[j] : wbuf[0];
                        }
                    }
                    lin_chunk(x + m0 * ldx + k0, ldx, ms, wp, kc, acc);
                }
                for (int m = 0; m < ms; m++) {
                    /* note: keep the optional pointers out of vectorizable
                       loops: a masked load from NULL costs a slow fault
                       suppression assist on some CPUs */
                    float s[LIN_NB];
                    for (int j = 0; j < LIN_NB; j++) s[j] = hsum16(acc + m * LIN_ACCS + j * 16);
                    if (fmt == FMT_I8)
                        for (int j = 0; j < nb; j++) s[j] = s[j] * scale[n0 + j];
                    if (bias != NULL)
                        for (int j = 0; j < nb; j++) s[j] = s[j] + bias[n0 + j];
                    memcpy(out + (m0 + m) * ldo + n0, s, sizeof(float) * (size_t)nb);
                }
            }
        }
    }
    return SS_OK;
}

SS_EXPORT int ss_has_avx512(void) {
#ifdef SS_AVX512
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------ */
/* exp (Cephes-style polynomial), vector and bit-identical scalar mirror    */
/* ------------------------------------------------------------------------ */

#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504f
#define LOG2EF 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
#define EXP_P0 1.9875691500E-4f
#define EXP_P1 1.3981999507E-3f
#define EXP_P2 8.3334519073E-3f
#define EXP_P3 4.1665795894E-2f
#define EXP_P4 1.6666665459E-1f
#define EXP_P5 5.0000001201E-1f

static inline float exp_scalar(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    float n = nearbyintf(x * LOG2EF);
    float r = fmaf(-n, EXP_C1, x);
    r = fmaf(-n, EXP_C2, r);
    float z = r * r;
    float y = EXP_P0;
    y = fmaf(y, r, EXP_P1);
    y = fmaf(y, r, EXP_P2);
    y = fmaf(y, r, EXP_P3);
    y = fmaf(y, r, EXP_P4);
    y = fmaf(y, r, EXP_P5);
    y = fmaf(y, z, r);
    y = y + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float p;
    memcpy(&p, &e, 4);
    return y * p;
}

#ifdef SS_AVX2
SS_INLINE __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2EF)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C1), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C2), r);
    __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_set1_ps(EXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P5));
    y = _mm256_fmadd_ps(y, z, r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* in-place exp(v[i] - mx); returns the sum in a fixed order (8 lanes + hsum8) */
static float exp_sub_sum(float *v, int n, float mx) {
    float lanes[8] SS_ALIGN = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
#ifdef SS_AVX2
    __m256 vm = _mm256_set1_ps(mx);
    __m256 s = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(v + i), vm));
        _mm256_storeu_ps(v + i, e);
        s = _mm256_add_ps(s, e);
    }
    _mm256_store_ps(lanes, s);
#else
    for (; i + 8 <= n; i += 8) {
        for (int l = 0; l < 8; l++) {
            float e = exp_scalar(v[i + l] - mx);
            v[i + l] = e;
            lanes[l] = lanes[l] + e;
        }
    }
#endif
    for (int l = 0; i < n; i++, l++) {
        float e = exp_scalar(v[i] - mx);
        v[i] = e;
        lanes[l] = lanes[l] + e;
    }
    return hsum8(lanes);
}

/* ------------------------------------------------------------------------ */
/* paged attention                                                          */
/* ------------------------------------------------------------------------ */

#define ATT_DMAX 1024
#define ATT_PF 16 /* keys the loops over cached rows prefetch ahead: the rows of one kv head are strided
                     by Hkv (and scattered over blocks), which the hardware prefetchers miss */

/* prefetch the n bytes at p */
SS_INLINE void prefetch_bytes(const void *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

#ifdef SS_AVX2
/* hsum8 of 8 vectors at once: out[j] = hsum8(a[j]) with exactly the same
   additions as the scalar hsum8 (only the data movement differs) */
SS_INLINE __m256 hsum8x8(const __m256 a[8]) {
    __m256 p01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
    __m256 p23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
    __m256 p45 = _mm256_add_ps(_mm256_permute2f128_ps(a[4], a[5], 0x20), _mm256_permute2f128_ps(a[4], a[5], 0x31));
    __m256 p67 = _mm256_add_ps(_mm256_permute2f128_ps(a[6], a[7], 0x20), _mm256_permute2f128_ps(a[6], a[7], 0x31));
    /* p01 = [s(a0) | s(a1)] with s_l = a_l + a_{l+4} */
    __m256 q0 = _mm256_add_ps(_mm256_shuffle_ps(p01, p23, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(p01, p23, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 q1 = _mm256_add_ps(_mm256_shuffle_ps(p45, p67, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(p45, p67, _MM_SHUFFLE(3, 2, 3, 2)));
    /* q0 = [t0(a0), t1(a0), t0(a2), t1(a2) | t0(a1), t1(a1), t0(a3), t1(a3)] */
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(q0, q1, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(q0, q1, _MM_SHUFFLE(3, 1, 3, 1)));
    /* r = [a0, a2, a4, a6 | a1, a3, a5, a7] */
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* dot8(q, k_j) for 8 keys at once (kp[j] may repeat for padding) */
SS_INLINE __m256 dot8x8(const float *qv, const float *const *kp, int D) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(qv + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kp[j] + d), a[j]);
    }
    if (d < D) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(D - d), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 qd = _mm256_maskload_ps(qv + d, mask);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qd, _mm256_maskload_ps(kp[j] + d, mask), a[j]);
    }
    return hsum8x8(a);
}
#endif

/* scores of one query head over keys [0, L): sc[i] = softcap(dot8(q, k_i) * scale) */
static float attn_scores(const float *qv, const float *kbase, const int64_t *koff, int64_t L, int D,
                         float scale, float softcap, float *sc, int pf) {
    float mx = -INFINITY;
    int64_t i = 0;
#ifdef SS_AVX2
    const __m256 vscale = _mm256_set1_ps(scale);
    for (; i < L; i += 8) {
        const float *kp[8];
        const int n8 = (int)(L - i < 8 ? L - i : 8);
        for (int64_t j = i + ATT_PF; pf && j < i + ATT_PF + 8 && j < L; j++) prefetch_bytes(kbase + koff[j], 4 * D);
        for (int j = 0; j < 8; j++) kp[j] = kbase + koff[i + (j < n8 ? j : 0)];
        float v[8] SS_ALIGN;
        _mm256_store_ps(v, _mm256_mul_ps(dot8x8(qv, kp, D), vscale));
        for (int j = 0; j < n8; j++) {
            float x = v[j];
            if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
            sc[i + j] = x;
            mx = x > mx ? x : mx;
        }
    }
#else
    for (; i < L; i++) {
        float x = dot8(qv, kbase + koff[i], D) * scale;
        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
        sc[i] = x;
        mx = x > mx ? x : mx;
    }
#endif
    return mx;
}

/* ------------------------------------------------------------------------ */
/* KV cache formats (keep in sync with ops.py KV_FORMATS)                   */
/*   Each (slot, kv head) row of D values is stored as:                     */
/*   F32 / BF16 / F16: D values of that type.                               */
/*   FP8_E4M3: D bytes (e4m3fn) + one fp32 scale: x = fp8(b) * s            */
/*   I8: D int8 + one fp32 scale: x = (float)q * s                          */
/*   I4: D/2 bytes (element 2i in the low nibble of byte i, 2i+1 in the     */
/*       high one) + per group of G elements fp32 (scale, min):             */
/*       x = (float)nib * s + m   (a multiply, then an add; no fma)         */
/*   Rows are dequantized to fp32 into a per-thread buffer and attention    */
/*   then runs the fp32 arithmetic unchanged, so results stay batch        */
/*   invariant and equal the fp32 kernel over the dequantized values.      */
/* ------------------------------------------------------------------------ */

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_FP8_E4M3 = 3, KV_I8 = 4, KV_I4 = 5 };

static float fp8_e4m3_lut[256];

__attribute__((constructor)) static void init_fp8_e4m3_lut(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v;
        if (e == 15 && m == 7) v = NAN;
        else if (e == 0) v = ldexpf((float)m, -9);
        else v = ldexpf((float)(8 + m), e - 10);
        fp8_e4m3_lut[b] = (b & 0x80) ? -v : v;
    }
}

SS_EXPORT float ss_fp8_e4m3_to_float(int b) { return fp8_e4m3_lut[b & 255]; }

/* elements [d0, d1) of one stored row into out[d0 .. d1) (int4: d0, d1 multiples of G);
   row = (block * BS + offset) * Hkv + kv_head. The SIMD loops do the same
   exact conversions and the same single multiply (and add, for int4) per
   element as the scalar tails, so every build gives the same values. */
static void kv_deq_row(int fmt, const void *base, const float *scales, int64_t row, int D, int G, int d0, int d1,
                       float *out) {
    int d = d0;
    switch (fmt) {
    case KV_BF16: {
        const uint16_t *p = (const uint16_t *)base + row * D;
#ifdef SS_AVX2
        for (; d + 8 <= d1; d += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + d)));
            _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
#endif
        for (; d < d1; d++) {
            uint32_t u = (uint32_t)p[d] << 16;
            memcpy(out + d, &u, 4);
        }
        break;
    }
    case KV_F16: {
        const uint8_t *p = (const uint8_t *)base + row * D * 2;
#if defined(SS_AVX2) && defined(SS_F16C)
        for (; d + 8 <= d1; d += 8)
            _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * d))));
#endif
        for (; d < d1; d++) out[d] = h2f(p + 2 * d);
        break;
    }
    case KV_FP8_E4M3: {
        const uint8_t *p = (const uint8_t *)base + row * D;
        const float s = scales[row];
#ifdef SS_AVX2
        const __m256 vs = _mm256_set1_ps(s);
        /* exact decode by bit manipulation (the same values as the table) */
        const __m256i c7f = _mm256_set1_epi32(0x7F), bias = _mm256_set1_epi32(120 << 23);
        const __m256 sub_scale = _mm256_set1_ps(1.0f / 512.0f), qnan = _mm256_set1_ps(NAN);
        for (; d + 8 <= d1; d += 8) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + d)));
            const __m256i em = _mm256_and_si256(b, c7f);
            const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
            /* normal: exponent e - 7 + 127 = e + 120, mantissa m << 20 */
            __m256 v = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), bias));
            /* subnormal (e == 0): m * 2^-9 */
            const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(7))), sub_scale);
            v = _mm256_blendv_ps(v, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em)));
            v = _mm256_blendv_ps(v, qnan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, c7f)));
            v = _mm256_or_ps(v, _mm256_castsi256_ps(sign));
            _mm256_storeu_ps(out + d, _mm256_mul_ps(v, vs));
        }
#endif
        for (; d < d1; d++) out[d] = fp8_e4m3_lut[p[d]] * s;
        break;
    }
    case KV_I8: {
        const int8_t *p = (const int8_t *)base + row * D;
        const float s = scales[row];
#ifdef SS_AVX2
        const __m256 vs = _mm256_set1_ps(s);
        for (; d + 8 <= d1; d += 8) {
            __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + d))));
            _mm256_storeu_ps(out + d, _mm256_mul_ps(f, vs));
        }
#endif
        for (; d < d1; d++) out[d] = (float)p[d] * s;
        break;
    }
    case KV_I4: {
        const uint8_t *p = (const uint8_t *)base + row * (D / 2);
        const int ng = D / G;
        const float *sm = scales + row * ng * 2;
        for (int g = d0 / G; g < d1 / G; g++) {
            const float s = sm[2 * g], m = sm[2 * g + 1];
            int j = 0;
#ifdef SS_AVX2
            const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
            const __m128i m4 = _mm_set1_epi8(0x0F);
            for (; j + 32 <= G; j += 32) {
                const int k0 = g * G + j;
                __m128i bytes = _mm_loadu_si128((const __m128i *)(p + k0 / 2));
                __m128i lo = _mm_and_si128(bytes, m4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), m4);
                __m128i e0 = _mm_unpacklo_epi8(lo, hi); /* elements k0 .. k0+15 */
                __m128i e1 = _mm_unpackhi_epi8(lo, hi); /* elements k0+16 .. k0+31 */
                __m128i parts[4] = {e0, _mm_srli_si128(e0, 8), e1, _mm_srli_si128(e1, 8)};
                for (int c = 0; c < 4; c++) {
                    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c]));
                    _mm256_storeu_ps(out + k0 + 8 * c, _mm256_add_ps(_mm256_mul_ps(f, vs), vm));
                }
            }
#endif
            for (; j < G; j++) {
                const int dd = g * G + j;
                const int nib = (p[dd >> 1] >> ((dd & 1) * 4)) & 15;
                out[dd] = (float)nib * s + m;
            }
        }
        break;
    }
    default:
        break;
    }
}

/* ------------------------------------------------------------------------ */
/* KV quantization: the bits of ops.kv_quantize (torch), row by row          */
/* ------------------------------------------------------------------------ */
/* Scalar code: a decode step writes a few rows per layer. Every step below is
   one IEEE operation rounded to nearest even (division, rint, the float to
   bf16 / f16 / e4m3 roundings), as torch does them, so the stored bytes equal
   kv_quantize's for finite inputs (a NaN input stores some NaN or 0). */

/* float -> bf16 bits, round to nearest even */
static inline uint16_t kv_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float -> IEEE half bits, round to nearest even */
static inline uint16_t kv_to_f16(float f) {
#ifdef SS_F16C
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u | (uint16_t)((a >> 13) & 0x3FFu); /* NaN, quieted */
    if (a >= 0x477FF000u) return sign | 0x7C00u;                                    /* rounds to Inf */
    if (a < 0x38800000u) { /* below 2^-14: the float add rounds to the half's subnormal step */
        float v;
        memcpy(&v, &a, 4);
        v += 0.5f;
        uint32_t r;
        memcpy(&r, &v, 4);
        return sign | (uint16_t)(r - 0x3F000000u);
    }
    return sign | (uint16_t)((a + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13);
#endif
}

/* float (|f| <= 448 or NaN) -> e4m3fn bits, round to nearest even */
static inline uint8_t kv_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)(u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a >= (1087u << 20)) return sign | 0x7Fu; /* >= 480, Inf, NaN: NaN */
    if (a < (121u << 23)) {                      /* below 2^-6: subnormal steps of 2^-9 */
        float v;
        memcpy(&v, &a, 4);
        v += 16384.0f; /* 2^14: its float step is 2^-9 */
        uint32_t r;
        memcpy(&r, &v, 4);
        return sign | (uint8_t)(r - (141u << 23));
    }
    return sign | (uint8_t)((a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20);
}

/* max |x| (NaN when any x is NaN, as torch's amax) */
static float kv_absmax(const float *x, int n) {
    float a = 0.0f;
    for (int i = 0; i < n; i++) {
        const float v = fabsf(x[i]);
        if (v != v) return v;
        if (v > a) a = v;
    }
    return a;
}

/* one (slot, kv head) row x[D] -> its storage: row `row` of base (and of scales) */
static void kv_quant_row(int fmt, const float *x, int D, int G, void *base, float *scales, int64_t row) {
    switch (fmt) {
    case KV_F32: memcpy((float *)base + row * D, x, sizeof(float) * (size_t)D); break;
    case KV_BF16: {
        uint16_t *p = (uint16_t *)base + row * D;
        for (int d = 0; d < D; d++) p[d] = kv_to_bf16(x[d]);
        break;
    }
    case KV_F16: {
        uint16_t *p = (uint16_t *)base + row * D;
        for (int d = 0; d < D; d++) p[d] = kv_to_f16(x[d]);
        break;
    }
    case KV_I8:
    case KV_FP8_E4M3: {
        const float qmax = fmt == KV_I8 ? 127.0f : 448.0f;
        float s = kv_absmax(x, D) / qmax;
        if (!(s > 0.0f)) s = 1.0f;
        scales[row] = s;
        if (fmt == KV_I8) {
            int8_t *p = (int8_t *)base + row * D;
            for (int d = 0; d < D; d++) {
                const float y = rintf(x[d] / s);
                p[d] = y != y ? 0 : (int8_t)(y > 127.0f ? 127.0f : y < -127.0f ? -127.0f : y);
            }
        } else {
            uint8_t *p = (uint8_t *)base + row * D;
            for (int d = 0; d < D; d++) {
                const float y = x[d] / s;
                p[d] = kv_to_e4m3(y > 448.0f ? 448.0f : y < -448.0f ? -448.0f : y);
            }
        }
        break;
    }
    case KV_I4: {
        uint8_t *p = (uint8_t *)base + row * (D / 2);
        float *sm = scales + row * (D / G) * 2;
        for (int g = 0; g < D / G; g++) {
            const float *xg = x + g * G;
            float mn = xg[0], mx = xg[0];
            for (int j = 1; j < G; j++) {
                if (xg[j] != xg[j] || mn != mn) mn = mx = NAN;
                else if (xg[j] < mn) mn = xg[j];
                else if (xg[j] > mx) mx = xg[j];
            }
            float s = (mx - mn) / 15.0f;
            if (!(s > 0.0f)) s = 1.0f;
            sm[2 * g] = s, sm[2 * g + 1] = mn;
            for (int j = 0; j < G; j += 2) {
                uint8_t q[2];
                for (int e = 0; e < 2; e++) {
                    const float y = rintf((xg[j + e] - mn) / s);
                    q[e] = y != y ? 0 : (uint8_t)(y > 15.0f ? 15.0f : y < 0.0f ? 0.0f : y);
                }
                p[(g * G + j) / 2] = (uint8_t)(q[0] | (q[1] << 4));
            }
        }
        break;
    }
    default: break;
    }
}

/* a KV format with its scale pools (NULL for the unscaled formats) and int4 group G (values
   per scale and min: even, dividing D) for head_dim D: SS_OK, SS_EFORMAT or SS_EINVAL */
static int kv_format_check(int fmt, const void *k_scales, const void *v_scales, int64_t D, int64_t G) {
    if (fmt < KV_F32 || fmt > KV_I4) return SS_EFORMAT;
    if ((fmt == KV_FP8_E4M3 || fmt == KV_I8 || fmt == KV_I4) && (!k_scales || !v_scales)) return SS_EINVAL;
    if (fmt == KV_I4 && (D % 2 != 0 || G <= 0 || G % 2 != 0 || D % G != 0)) return SS_EINVAL;
    return SS_OK;
}

/* rows x[n, D] -> dst (row i of the pool layout) and scales; G: the int4 group (else ignored) */
SS_EXPORT int ss_kv_quantize(int fmt, const float *x, int64_t n, int64_t D, int64_t G, void *dst, float *scales) {
    if (n < 0 || D <= 0) return SS_EINVAL;
    const int rc = kv_format_check(fmt, scales, scales, D, G);
    if (rc) return rc;
    for (int64_t i = 0; i < n; i++) kv_quant_row(fmt, x + i * D, (int)D, (int)G, dst, scales, i);
    return SS_OK;
}

#define ATT_QV 4 /* query vectors per block of the multi-vector kernels */
#define ATT_QT 4 /* rows of one sequence per work item (with the heads of a kv head) */
#define ATT_VMAX 64 /* query vectors per work item at most (rows x heads) */

#ifdef SS_AVX2
/* out[v] = the 8 scores dot8x8(qv[v], kp) for v < NV: per (vector, key) the same lanes, FMAs
   and hsum8x8 as dot8x8; each K row load serves NV vectors */
SS_INLINE void dot8x8_multi(const int NV, const float *const *qv, const float *const *kp, int D, __m256 *out) {
    __m256 a[ATT_QV][8];
    for (int h = 0; h < 8; h += 4) { /* keys h .. h + 3 (half the accumulators live at a time) */
        for (int v = 0; v < NV; v++)
            for (int j = 0; j < 4; j++) a[v][h + j] = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= D; d += 8) {
            const __m256 k0 = _mm256_loadu_ps(kp[h] + d), k1 = _mm256_loadu_ps(kp[h + 1] + d);
            const __m256 k2 = _mm256_loadu_ps(kp[h + 2] + d), k3 = _mm256_loadu_ps(kp[h + 3] + d);
            for (int v = 0; v < NV; v++) {
                const __m256 qd = _mm256_loadu_ps(qv[v] + d);
                a[v][h] = _mm256_fmadd_ps(qd, k0, a[v][h]);
                a[v][h + 1] = _mm256_fmadd_ps(qd, k1, a[v][h + 1]);
                a[v][h + 2] = _mm256_fmadd_ps(qd, k2, a[v][h + 2]);
                a[v][h + 3] = _mm256_fmadd_ps(qd, k3, a[v][h + 3]);
            }
        }
        if (d < D) {
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(D - d), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int j = 0; j < 4; j++) {
                const __m256 kd = _mm256_maskload_ps(kp[h + j] + d, mask);
                for (int v = 0; v < NV; v++)
                    a[v][h + j] = _mm256_fmadd_ps(_mm256_maskload_ps(qv[v] + d, mask), kd, a[v][h + j]);
            }
        }
    }
    for (int v = 0; v < NV; v++) out[v] = hsum8x8(a[v]);
}
#endif

#ifdef SS_AVX512
/* dot8x8_multi with two keys per 512-bit register (lanes 0-7 key 2p, 8-15 key 2p + 1): the
   same lanes, FMAs (masked tail included) and hsum8x8 per (vector, key), half the FMAs */
SS_INLINE __m512 join8x2(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
SS_INLINE void dot8x8_multi512(const int NV, const float *const *qv, const float *const *kp, int D, __m256 *out) {
    __m512 a[ATT_QV][4];
    for (int v = 0; v < NV; v++)
        for (int p = 0; p < 4; p++) a[v][p] = _mm512_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m512 k[4];
        for (int p = 0; p < 4; p++) k[p] = join8x2(_mm256_loadu_ps(kp[2 * p] + d), _mm256_loadu_ps(kp[2 * p + 1] + d));
        for (int v = 0; v < NV; v++) {
            const __m256 q8 = _mm256_loadu_ps(qv[v] + d);
            const __m512 qd = join8x2(q8, q8);
            for (int p = 0; p < 4; p++) a[v][p] = _mm512_fmadd_ps(qd, k[p], a[v][p]);
        }
    }
    if (d < D) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(D - d), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m512 k[4];
        for (int p = 0; p < 4; p++)
            k[p] = join8x2(_mm256_maskload_ps(kp[2 * p] + d, mask), _mm256_maskload_ps(kp[2 * p + 1] + d, mask));
        for (int v = 0; v < NV; v++) {
            const __m256 q8 = _mm256_maskload_ps(qv[v] + d, mask);
            const __m512 qd = join8x2(q8, q8);
            for (int p = 0; p < 4; p++) a[v][p] = _mm512_fmadd_ps(qd, k[p], a[v][p]);
        }
    }
    for (int v = 0; v < NV; v++) {
        __m256 t[8];
        for (int p = 0; p < 4; p++) {
            t[2 * p] = _mm512_castps512_ps256(a[v][p]);
            t[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[v][p]), 1));
        }
        out[v] = hsum8x8(t);
    }
}
#define DOT8X8_MULTI dot8x8_multi512
#else
#define DOT8X8_MULTI dot8x8_multi
#endif

/* scores of nv vectors qs[v] over keys [0, L) (L % 8 == 0 on AVX2 builds) into scs[v], mx[v] updated:
   per (vector, key) exactly attn_scores' value */
static void attn_scores_multi(const float *const *qs, int nv, const float *kbase, const int64_t *koff, int64_t L,
                              int D, float scale, float softcap, float *const *scs, float *mx, int pf) {
#ifdef SS_AVX2
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int v0 = 0; v0 < nv; v0 += ATT_QV) {
        const int n = nv - v0 < ATT_QV ? nv - v0 : ATT_QV;
        for (int64_t i = 0; i < L; i += 8) {
            const float *kp[8];
            for (int64_t j = i + ATT_PF; pf && v0 == 0 && j < i + ATT_PF + 8 && j < L; j++)
                prefetch_bytes(kbase + koff[j], 4 * D);
            for (int j = 0; j < 8; j++) kp[j] = kbase + koff[i + j];
            __m256 r[ATT_QV];
            switch (n) {
            case 4: DOT8X8_MULTI(4, qs + v0, kp, D, r); break;
            case 3: DOT8X8_MULTI(3, qs + v0, kp, D, r); break;
            case 2: DOT8X8_MULTI(2, qs + v0, kp, D, r); break;
            default: r[0] = dot8x8(qs[v0], kp, D); break; /* 8 accumulator chains, not 4 */
            }
            for (int w = 0; w < n; w++) {
                float x8[8] SS_ALIGN;
                _mm256_store_ps(x8, _mm256_mul_ps(r[w], vscale));
                float *scv = scs[v0 + w] + i, m = mx[v0 + w];
                for (int j = 0; j < 8; j++) {
                    float x = x8[j];
                    if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                    scv[j] = x;
                    m = x > m ? x : m;
                }
                mx[v0 + w] = m;
            }
        }
    }
#else
    for (int v = 0; v < nv; v++) {
        const float m = attn_scores(qs[v], kbase, koff, L, D, scale, softcap, scs[v], pf);
        mx[v] = m > mx[v] ? m : mx[v];
    }
#endif
}

/* acc[v][d] += sum_i pw[v][i] * v_i[d] for v < NV over keys [0, L): per element one fused
   multiply-add per key, in key order (the same whatever the vector width, and whether the keys
   come in one call or in consecutive ranges); each V row load serves NV vectors */
SS_INLINE void values_multi(const int NV, const float *const *pw, const float *vbase, const int64_t *voff, int64_t L,
                            int D, float *const *acc, int pf) {
    int d0 = 0;
#if defined(SS_AVX512)
    for (; d0 + 64 <= D; d0 += 64) {
        __m512 a[ATT_QV][4];
        for (int v = 0; v < NV; v++)
            for (int c = 0; c < 4; c++) a[v][c] = _mm512_loadu_ps(acc[v] + d0 + 16 * c);
        for (int64_t i = 0; i < L; i++) {
            const float *vr = vbase + voff[i] + d0;
            if (pf && d0 == 0 && i + ATT_PF < L) prefetch_bytes(vbase + voff[i + ATT_PF], 4 * D);
            const __m512 x0 = _mm512_loadu_ps(vr), x1 = _mm512_loadu_ps(vr + 16);
            const __m512 x2 = _mm512_loadu_ps(vr + 32), x3 = _mm512_loadu_ps(vr + 48);
            for (int v = 0; v < NV; v++) {
                const __m512 p = _mm512_set1_ps(pw[v][i]);
                a[v][0] = _mm512_fmadd_ps(p, x0, a[v][0]);
                a[v][1] = _mm512_fmadd_ps(p, x1, a[v][1]);
                a[v][2] = _mm512_fmadd_ps(p, x2, a[v][2]);
                a[v][3] = _mm512_fmadd_ps(p, x3, a[v][3]);
            }
        }
        for (int v = 0; v < NV; v++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc[v] + d0 + 16 * c, a[v][c]);
    }
#endif
#if defined(SS_AVX2)
    for (; d0 + 16 <= D; d0 += 16) {
        __m256 a[ATT_QV][2];
        for (int v = 0; v < NV; v++)
            for (int c = 0; c < 2; c++) a[v][c] = _mm256_loadu_ps(acc[v] + d0 + 8 * c);
        for (int64_t i = 0; i < L; i++) {
            const float *vr = vbase + voff[i] + d0;
            if (pf && d0 == 0 && i + ATT_PF < L) prefetch_bytes(vbase + voff[i + ATT_PF], 4 * D);
            const __m256 x0 = _mm256_loadu_ps(vr), x1 = _mm256_loadu_ps(vr + 8);
            for (int v = 0; v < NV; v++) {
                const __m256 p = _mm256_set1_ps(pw[v][i]);
                a[v][0] = _mm256_fmadd_ps(p, x0, a[v][0]);
                a[v][1] = _mm256_fmadd_ps(p, x1, a[v][1]);
            }
        }
        for (int v = 0; v < NV; v++)
            for (int c = 0; c < 2; c++) _mm256_storeu_ps(acc[v] + d0 + 8 * c, a[v][c]);
    }
#endif
    for (int64_t i = 0; d0 < D && i < L; i++) {
        const float *vr = vbase + voff[i];
        for (int v = 0; v < NV; v++)
            for (int d = d0; d < D; d++) acc[v][d] = fmaf(pw[v][i], vr[d], acc[v][d]);
    }
}

static void attn_values_multi(const float *const *pw, int nv, const float *vbase, const int64_t *voff, int64_t L,
                              int D, float *const *acc, int pf) {
    for (int v0 = 0; v0 < nv; v0 += ATT_QV) {
        switch (nv - v0 < ATT_QV ? nv - v0 : ATT_QV) {
        case 4: values_multi(4, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        case 3: values_multi(3, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        case 2: values_multi(2, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        default: values_multi(1, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        }
    }
}

#define ATT_TILE 64 /* keys per dequantized tile (a multiple of 8: the score groups stay the same) */
#define ATT_COOP_KEYS 256 /* keys an item needs before threads share it (attn_coop) */

/* bytes of one stored (slot, kv head) row, and of its scales */
static int64_t kv_row_bytes(int fmt, int64_t D) {
    return fmt == KV_F32 ? 4 * D : fmt == KV_BF16 || fmt == KV_F16 ? 2 * D : fmt == KV_I4 ? D / 2 : D;
}
static int64_t kv_scale_bytes(int fmt, int64_t D, int64_t G) {
    return fmt == KV_I8 || fmt == KV_FP8_E4M3 ? 4 : fmt == KV_I4 ? 8 * (D / G) : 0;
}

/* prefetch bytes [b0, b0 + nb) of row rows[i] (when i < L) of a pool (rows of rb bytes), and its scales */
SS_INLINE void kv_prefetch(const void *base, const float *scales, const int64_t *rows, int64_t i, int64_t L,
                           int64_t rb, int64_t sb, int64_t b0, int64_t nb) {
    if (i >= L) return;
    prefetch_bytes((const char *)base + rows[i] * rb + b0, nb);
    if (sb) __builtin_prefetch((const char *)scales + rows[i] * sb, 0, 3);
}

/* keys [i0, i0 + n) of one pool as fp32 rows, of which dims [d0, d1) are read: an fp32 cache
   gives its own rows (*o = off + i0, float offsets into the pool); a quantized one dequantizes
   those dims into buf (row i at buf + i * D; off: rows; *o: offsets into buf), prefetching the
   rows ahead */
static const float *kv_tile(int fmt, const void *pool, const float *scales, int64_t G, const int64_t *off, int64_t i0,
                            int64_t n, int64_t L, int D, int d0, int d1, float *buf, const int64_t *toff,
                            const int64_t **o) {
    if (fmt == KV_F32) {
        *o = off + i0;
        return (const float *)pool;
    }
    const int64_t rb = kv_row_bytes(fmt, D), sb = kv_scale_bytes(fmt, D, G);
    const int64_t b0 = kv_row_bytes(fmt, d0), nb = kv_row_bytes(fmt, d1 - d0);
    for (int64_t i = 0; i < n; i++) {
        kv_prefetch(pool, scales, off, i0 + i + ATT_PF, L, rb, sb, b0, nb);
        kv_deq_row(fmt, pool, scales, off[i0 + i], D, (int)G, d0, d1, buf + i * D);
    }
    *o = toff;
    return buf;
}

/* the first key a query at position pos sees (window 0: every key from 0) */
SS_INLINE int64_t att_first_key(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* the keys of [lo, hi) in the tile [t0, t1) outside the common range [cs, ce) (none when
   ce <= cs): seg[0] .. seg[1] before it, seg[2] .. seg[3] after it (empty when end <= start) */
SS_INLINE void own_segments(int64_t lo, int64_t hi, int64_t cs, int64_t ce, int64_t t0, int64_t t1, int64_t seg[4]) {
    const int64_t a = lo > t0 ? lo : t0, b = hi < t1 ? hi : t1;
    if (ce <= cs) {
        seg[0] = a, seg[1] = b, seg[2] = seg[3] = 0;
        return;
    }
    seg[0] = a, seg[1] = b < cs ? b : cs;
    seg[2] = a > ce ? a : ce, seg[3] = b;
}

/*
 * One work item: nv query vectors (rows of one sequence x heads of one kv head); vector v has
 * query qs[v], keys lo[v] .. hi[v] - 1 of the item's key range (off[]: see kv_tile), scores in
 * scv[v], output outs[v]. Keys go by tiles of ATT_TILE (dequantized once for all vectors; an
 * fp32 cache: one tile per key range). The keys every vector has (rounded down to a multiple of
 * 8) go through the multi-vector kernels, each vector's other keys (before and after them)
 * vector by vector, in key order. Per (vector, key) the arithmetic is that of the vector alone
 * (scores per key, exp_sub_sum over its own keys, V sums in key order), so a row's output does
 * not depend on the rows it shares an item with.
 *
 * An item runs in three phases: scores over a key range (item_scores), exp / sum per vector
 * (item_exps), V sums over a range of head dims (item_values). One thread runs all three over
 * the whole item (attn_item); when there are fewer items than threads, the threads share each
 * phase out (attn_coop) with the same arithmetic: scores and exps are per
 * key, the max is exact in any order, and each V sum still goes key by key for its dims.
 */
typedef struct {
    int fmt, nv, D;
    const void *kc, *vc;
    const float *ksc, *vsc;
    int64_t G;
    const int64_t *off; /* key offsets (fp32: floats into the pool; quantized: rows) */
    float scale, softcap;
    const float *qs[ATT_VMAX];
    float *outs[ATT_VMAX], *scv[ATT_VMAX], *accs[ATT_VMAX]; /* scv[v][i - lo[v]]: key i */
    int64_t lo[ATT_VMAX], hi[ATT_VMAX];
    float *mx, *sum; /* per vector */
    int64_t L, cs, ce; /* keys [0, L); the common keys [cs, ce) */
    int64_t toff[ATT_TILE]; /* quantized: offsets of a dequantized tile's rows (kv_tile) */
} AttItem;

/* the item of (row tile t .. t + nt - 1, heads h0 .. h0 + nh - 1 of kv head kvh); off: span
   int64s, sc: nv * maxlen floats, acc: nv * (D + 2) floats */
static void item_setup(AttItem *it, int fmt, const float *q, float *out, const void *kc, const void *vc,
                       const float *ksc, const float *vsc, int64_t G, int64_t BS, int64_t Hkv, int64_t Hq,
                       int64_t D, const int32_t *bt, const int32_t *positions, int64_t window, int64_t t,
                       int64_t nt, int64_t kvh, int64_t h0, int64_t nh, float scale, float softcap, int64_t *off,
                       float *sc, int64_t maxlen, float *acc) {
    int64_t first = INT64_MAX, last = 0; /* the item's keys: positions first .. last */
    for (int64_t r = 0; r < nt; r++) {
        const int64_t pos = positions[t + r], start = att_first_key(pos, window);
        first = start < first ? start : first;
        last = pos > last ? pos : last;
    }
    for (int64_t p = first; p <= last; p++)
        off[p - first] = (((int64_t)bt[p / BS] * BS + p % BS) * Hkv + kvh) * (fmt == KV_F32 ? D : 1);
    *it = (AttItem){.fmt = fmt, .nv = (int)(nt * nh), .D = (int)D, .kc = kc, .vc = vc, .ksc = ksc, .vsc = vsc,
                    .G = G, .off = off, .scale = scale, .softcap = softcap};
    it->mx = acc + (int64_t)it->nv * D, it->sum = it->mx + it->nv;
    for (int i = 0; fmt != KV_F32 && i < ATT_TILE; i++) it->toff[i] = (int64_t)i * D;
    int64_t cs = 0, ce = INT64_MAX;
    for (int64_t r = 0, v = 0; r < nt; r++) {
        const int64_t pos = positions[t + r], start = att_first_key(pos, window);
        for (int64_t g = 0; g < nh; g++, v++) {
            it->qs[v] = q + ((t + r) * Hq + h0 + g) * D;
            it->outs[v] = out + ((t + r) * Hq + h0 + g) * D;
            it->lo[v] = start - first, it->hi[v] = pos - first + 1;
            it->scv[v] = sc + v * maxlen, it->accs[v] = acc + v * D;
            it->mx[v] = -INFINITY;
            it->L = it->hi[v] > it->L ? it->hi[v] : it->L;
            cs = it->lo[v] > cs ? it->lo[v] : cs;
            ce = it->hi[v] < ce ? it->hi[v] : ce;
        }
    }
    it->cs = cs, it->ce = ce > cs ? cs + (ce - cs) / 8 * 8 : cs;
}

/* length of the tile at key i0 of a range ending at k1: tiles start at keys congruent to cs mod
   8 (a first short tile before them), so the part of the common range in a tile is a multiple of
   8 keys, as the multi-vector kernels need; fp32 (no buffer): the rest of the range */
SS_INLINE int64_t item_tile(const AttItem *it, int64_t i0, int64_t k1) {
    const int64_t n = i0 == 0 && it->cs % 8 ? it->cs % 8 : it->fmt == KV_F32 ? k1 - i0 : ATT_TILE;
    return k1 - i0 < n ? k1 - i0 : n;
}

/* scores of the keys [k0, k1) (k0: 0 or congruent to cs mod 8; k1: L or congruent to it), the
   max of each vector's among them into mx[v] */
static void item_scores(const AttItem *it, int64_t k0, int64_t k1, float *mx, float *kvbuf) {
    int64_t seg[4];
    const int pf = it->fmt == KV_F32; /* prefetch the pool's rows (a dequantized tile is in L1) */
    const int nv = it->nv;
    float *tsc[ATT_VMAX];
    const int64_t *o;
    for (int64_t i0 = k0, n; i0 < k1; i0 += n) {
        n = item_tile(it, i0, k1);
        const int64_t c0 = it->cs > i0 ? it->cs : i0, c1 = it->ce < i0 + n ? it->ce : i0 + n;
        const float *kb = kv_tile(it->fmt, it->kc, it->ksc, it->G, it->off, i0, n, k1, it->D, 0, it->D, kvbuf, it->toff, &o);
        if (c1 > c0) {
            for (int v = 0; v < nv; v++) tsc[v] = it->scv[v] + (c0 - it->lo[v]);
            attn_scores_multi(it->qs, nv, kb, o + (c0 - i0), c1 - c0, it->D, it->scale, it->softcap, tsc, mx, pf);
        }
        for (int v = 0; v < nv; v++) {
            own_segments(it->lo[v], it->hi[v], it->cs, it->ce, i0, i0 + n, seg);
            for (int j = 0; j < 4; j += 2) {
                if (seg[j + 1] <= seg[j]) continue;
                const float m = attn_scores(it->qs[v], kb, o + (seg[j] - i0), seg[j + 1] - seg[j], it->D, it->scale,
                                            it->softcap, it->scv[v] + (seg[j] - it->lo[v]), pf);
                mx[v] = m > mx[v] ? m : mx[v];
            }
        }
    }
}

/* vector v: scores -> exp(score - max), their sum */
static void item_exps(const AttItem *it, int v) {
    it->sum[v] = exp_sub_sum(it->scv[v], (int)(it->hi[v] - it->lo[v]), it->mx[v]);
}

/* outputs [d0, d1) of every vector: V sums over all keys in key order, divided by the sum */
static void item_values(const AttItem *it, int d0, int d1, float *kvbuf) {
    int64_t seg[4];
    const int pf = it->fmt == KV_F32, nv = it->nv, nd = d1 - d0;
    float *tsc[ATT_VMAX], *ac[ATT_VMAX];
    for (int v = 0; v < nv; v++) {
        ac[v] = it->accs[v] + d0;
        for (int d = 0; d < nd; d++) ac[v][d] = 0.0f;
    }
    const int64_t *o;
    for (int64_t i0 = 0, n; i0 < it->L; i0 += n) {
        n = item_tile(it, i0, it->L);
        const int64_t c0 = it->cs > i0 ? it->cs : i0, c1 = it->ce < i0 + n ? it->ce : i0 + n;
        const float *vb = kv_tile(it->fmt, it->vc, it->vsc, it->G, it->off, i0, n, it->L, it->D, d0, d1, kvbuf, it->toff, &o) + d0;
        for (int j = 0; j < 4; j += 2) {
            for (int v = 0; v < nv; v++) {
                own_segments(it->lo[v], it->hi[v], it->cs, it->ce, i0, i0 + n, seg);
                const float *pw = it->scv[v] + (seg[j] - it->lo[v]);
                if (seg[j + 1] > seg[j]) values_multi(1, &pw, vb, o + (seg[j] - i0), seg[j + 1] - seg[j], nd, ac + v, pf);
            }
            if (j == 0 && c1 > c0) { /* between the keys before and after: the common ones */
                for (int v = 0; v < nv; v++) tsc[v] = it->scv[v] + (c0 - it->lo[v]);
                attn_values_multi((const float *const *)tsc, nv, vb, o + (c0 - i0), c1 - c0, nd, ac, pf);
            }
        }
    }
    for (int v = 0; v < nv; v++)
        for (int d = 0; d < nd; d++) it->outs[v][d0 + d] = ac[v][d] / it->sum[v];
}

/* one thread, the whole item; kvbuf: ATT_TILE * D floats (quantized formats) */
static void attn_item(const AttItem *it, float *kvbuf) {
    item_scores(it, 0, it->L, it->mx, kvbuf);
    for (int v = 0; v < it->nv; v++) item_exps(it, v);
    item_values(it, 0, it->D, kvbuf);
}

/* key j of n near-equal chunks of [0, L): 0, L, or congruent to cs mod 8 (see item_scores) */
static int64_t coop_key(const AttItem *it, int64_t j, int64_t n) {
    if (j >= n) return it->L;
    const int64_t x = it->L * j / n, r = it->cs % 8;
    return x < r ? 0 : r + (x - r) / 8 * 8;
}

/* dim j of n near-equal parts of [0, D), at multiples of 16 (whole SIMD chunks) and, for int4,
   of its group (a thread dequantizes only its own dims) */
static int coop_dim(const AttItem *it, int j, int n) {
    const int a = it->fmt == KV_I4 && it->G > 16 ? (int)it->G : 16;
    return j >= n ? it->D : it->D * j / n / a * a;
}

/* all items shared by nthreads threads phase by phase (scores by key chunks, exps by vector, V
   sums by head-dim parts); pmx: items * nthreads * ATT_VMAX floats for the chunks' maxima */
static int attn_coop(AttItem *its, int64_t items, int nthreads, float *pmx) {
    const int64_t nc = nthreads, D = its[0].D;
    int64_t vstart[64 + 1]; /* items < nthreads <= 64 */
    vstart[0] = 0;
    for (int64_t i = 0; i < items; i++) vstart[i + 1] = vstart[i] + its[i].nv;
    int err = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *kvbuf = NULL;
        if (its[0].fmt != KV_F32 && !(kvbuf = (float *)malloc(sizeof(float) * (size_t)(ATT_TILE * D + 16)))) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t task = 0; task < items * nc; task++) {
            const AttItem *it = its + task / nc;
            float *m = pmx + task * ATT_VMAX;
            for (int v = 0; v < it->nv; v++) m[v] = -INFINITY;
            if (!err) item_scores(it, coop_key(it, task % nc, nc), coop_key(it, task % nc + 1, nc), m, kvbuf);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < vstart[items]; task++) {
            int64_t i = 0;
            while (vstart[i + 1] <= task) i++;
            const int v = (int)(task - vstart[i]);
            float m = -INFINITY;
            for (int64_t c = 0; c < nc; c++) { /* the chunks in key order: the sequential max */
                const float x = pmx[(i * nc + c) * ATT_VMAX + v];
                m = x > m ? x : m;
            }
            its[i].mx[v] = m;
            item_exps(its + i, v);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < items * nc; task++) {
            const AttItem *it = its + task / nc;
            if (!err) item_values(it, coop_dim(it, (int)(task % nc), (int)nc), coop_dim(it, (int)(task % nc) + 1, (int)nc), kvbuf);
        }
        free(kvbuf);
    }
    return err;
}

/*
 * q:            [T, Hq, D]
 * k/v cache:    [NB, BS, Hkv, D]
 * block_tables: [S, max_blocks]
 * seq_ids, positions: [T]
 * out:          [T, Hq, D]
 *
 * Work item = (up to ATT_QT rows of one sequence (at consecutive positions
 * with a sliding window), kv head, the group of query heads sharing it): the key
 * offsets are resolved once per item, and each K / V row is read (or
 * dequantized) once for all its query vectors (attn_item). Per (query, head)
 * the arithmetic is fixed: scores per key, max, exp/sum (exp_sub_sum), V
 * accumulation in key order, division by the sum; so a row's output does not
 * depend on the other rows of the call or the thread count.
 */
static int paged_attention_core(int fmt, const float *q, const void *kc, const void *vc, const float *ksc,
                                const float *vsc, int64_t G, int64_t num_blocks, int64_t BS, int64_t Hkv,
                                const int32_t *block_tables, int64_t S, int64_t max_blocks,
                                const int32_t *seq_ids, const int32_t *positions, int64_t T, int64_t Hq,
                                int64_t D, float scale, int64_t window, float softcap, float *out,
                                int nthreads) {
    if (T < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D > ATT_DMAX || BS <= 0 || Hq % Hkv != 0)
        return SS_EINVAL;
    const int frc = kv_format_check(fmt, ksc, vsc, D, G);
    if (frc) return frc;
    if (T == 0) return SS_OK;
    /* validate indices before touching memory */
    int64_t maxlen = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t s = seq_ids[t], pos = positions[t];
        if (s < 0 || s >= S) return SS_ESEQ;
        if (pos < 0 || pos / BS >= max_blocks) return SS_EPOS;
        int64_t start = att_first_key(pos, window);
        for (int64_t b = start / BS; b <= pos / BS; b++) {
            int32_t blk = block_tables[s * max_blocks + b];
            if (blk < 0 || blk >= num_blocks) return SS_EBLOCK;
        }
        if (pos - start + 1 > maxlen) maxlen = pos - start + 1;
    }
    nthreads = resolve_threads(nthreads);
    const int64_t group = Hq / Hkv;
    /* rows per work item: up to ATT_QT rows of one sequence (each K / V row is read, or
       dequantized, once for all of them and their heads); with a window, only rows at
       consecutive positions, so that the item's keys (the union of theirs, all validated
       above) have no gap. span: the most keys an item covers. */
    const int64_t qt = group <= ATT_VMAX ? (ATT_VMAX / group < ATT_QT ? ATT_VMAX / group : ATT_QT) : 1;
    int64_t *tile0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T + 1)), ntiles = 0, span = 0;
    if (!tile0) return SS_ENOMEM;
    for (int64_t t = 0; t < T; ntiles++) {
        int64_t n = 1, lo = positions[t], hi = positions[t];
        while (n < qt && t + n < T && seq_ids[t + n] == seq_ids[t] &&
               (window == 0 || positions[t + n] == positions[t + n - 1] + 1)) {
            lo = positions[t + n] < lo ? positions[t + n] : lo;
            hi = positions[t + n] > hi ? positions[t + n] : hi;
            n++;
        }
        lo = att_first_key(lo, window);
        span = hi - lo + 1 > span ? hi - lo + 1 : span;
        tile0[ntiles] = t;
        t += n;
    }
    tile0[ntiles] = T;
    /* heads per work item: the whole group of a kv head (its vectors share each K / V row), in
       near-equal parts of at most ATT_VMAX. Which heads share an item does not change any head's
       arithmetic. */
    const int64_t parts = (group + ATT_VMAX - 1) / ATT_VMAX;
    const int64_t items = ntiles * Hkv * parts, nvmax = qt * ((group + parts - 1) / parts);
    const double work = (double)T * Hq * (double)maxlen * (double)D;
    /* fewer items than threads (decode: one row, fewer kv heads than threads) over enough keys:
       the threads share each item's phases instead of some of them idling. (3 items on 2
       threads measured no faster shared: a single thread nearly saturates memory there.) */
    const int coop = items < nthreads && nthreads <= 64 && maxlen >= ATT_COOP_KEYS;
    const int par = nthreads > 1 && items > 1 && work > 30000.0;
    int err = 0;
#define ITEM_SETUP(IT, I, OFF, SC, ACC)                                                                    \
    do {                                                                                                   \
        const int64_t tl = (I) / (Hkv * parts), t = tile0[tl], nt = tile0[tl + 1] - t;                     \
        const int64_t kvh = (I) % (Hkv * parts) / parts, part = (I) % parts;                               \
        const int64_t h0 = kvh * group + part * group / parts, nh = kvh * group + (part + 1) * group / parts - h0; \
        item_setup(IT, fmt, q, out, kc, vc, ksc, vsc, G, BS, Hkv, Hq, D, block_tables + seq_ids[t] * max_blocks, \
                   positions, window, t, nt, kvh, h0, nh, scale, softcap, OFF, SC, maxlen, ACC);           \
    } while (0)
    if (coop) {
        AttItem *its = (AttItem *)malloc(sizeof(AttItem) * (size_t)items);
        int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(items * (span + 16)));
        float *sc = (float *)malloc(sizeof(float) * (size_t)(items * (nvmax * maxlen + 16)));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(items * (nvmax * (D + 2) + 16)));
        float *pmx = (float *)malloc(sizeof(float) * (size_t)(items * nthreads * ATT_VMAX));
        err = !its || !off || !sc || !acc || !pmx;
        for (int64_t i = 0; !err && i < items; i++)
            ITEM_SETUP(its + i, i, off + i * (span + 16), sc + i * (nvmax * maxlen + 16), acc + i * (nvmax * (D + 2) + 16));
        if (!err) err = attn_coop(its, items, nthreads, pmx);
        free(its), free(off), free(sc), free(acc), free(pmx), free(tile0);
        return err ? SS_ENOMEM : SS_OK;
    }

#pragma omp parallel num_threads(nthreads) if (par)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(nvmax * maxlen + 16));
        int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(span + 16));
        /* quantized formats: ATT_TILE K or V rows of one kv head dequantized to fp32 at a time
           (small enough to stay in L1 / L2); the V sums of the item's vectors */
        float *kvbuf = NULL, *acc = (float *)malloc(sizeof(float) * (size_t)(nvmax * (D + 2) + 16));
        if (fmt != KV_F32) kvbuf = (float *)malloc(sizeof(float) * (size_t)(ATT_TILE * D + 16));
        if (!acc || (fmt != KV_F32 && !kvbuf)) {
            free(sc);
            sc = NULL;
        }
        if (!sc || !off) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!sc || !off) continue;
            AttItem it;
            ITEM_SETUP(&it, i, off, sc, acc);
            attn_item(&it, kvbuf);
        }
        free(sc);
        free(off);
        free(kvbuf);
        free(acc);
    }
#undef ITEM_SETUP
    free(tile0);
    return err ? SS_ENOMEM : SS_OK;
}

SS_EXPORT int ss_paged_attention(const float *q, const float *kc, const float *vc, int64_t num_blocks,
                                 int64_t BS, int64_t Hkv, const int32_t *block_tables, int64_t S,
                                 int64_t max_blocks, const int32_t *seq_ids, const int32_t *positions,
                                 int64_t T, int64_t Hq, int64_t D, float scale, int64_t window,
                                 float softcap, float *out, int nthreads) {
    return paged_attention_core(KV_F32, q, kc, vc, NULL, NULL, 0, num_blocks, BS, Hkv, block_tables, S,
                                max_blocks, seq_ids, positions, T, Hq, D, scale, window, softcap, out, nthreads);
}

/* paged attention over a KV cache in format fmt (KV_*); ksc / vsc: the scale
   pools (fp8 / int8: [NB, BS, Hkv]; int4: [NB, BS, Hkv, D / G, 2]) */
SS_EXPORT int ss_paged_attention_kv(int fmt, const float *q, const void *kc, const void *vc, const float *ksc,
                                    const float *vsc, int64_t G, int64_t num_blocks, int64_t BS, int64_t Hkv,
                                    const int32_t *block_tables, int64_t S, int64_t max_blocks,
                                    const int32_t *seq_ids, const int32_t *positions, int64_t T, int64_t Hq,
                                    int64_t D, float scale, int64_t window, float softcap, float *out,
                                    int nthreads) {
    return paged_attention_core(fmt, q, kc, vc, ksc, vsc, G, num_blocks, BS, Hkv, block_tables, S, max_blocks,
                                seq_ids, positions, T, Hq, D, scale, window, softcap, out, nthreads);
}

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
