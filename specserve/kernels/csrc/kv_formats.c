/* Part of cpu_kernels.c (exp, KV cache formats and KV quantization): not compiled alone, cpu_kernels.c includes it
 * in order (one translation unit; build.py hashes every csrc file). */

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
/* the loops over cached rows prefetch ATT_PF keys ahead: the rows of one kv head are strided by Hkv
   (and scattered over blocks), which the hardware prefetchers miss. Into L2 (prefetcht1), 32 keys
   ahead: prefetcht0 16 keys ahead left smollm2-135m's one-row forward at 16.3 ms instead of 11.8 at
   2048 keys of context, 7.0 instead of 6.3 at 512 (Zen 4, benchmarks/decode_cost.py --variants,
   results_final/zen4_1203/att_prefetch_*.md) */
#ifndef ATT_PF
#define ATT_PF 32
#endif
#ifndef ATT_PF_HINT
#define ATT_PF_HINT 2
#endif

/* prefetcht0 instead of the default hints (ATT_PF_HINT here, QP_PF_HINT for the weight panels in
   linear_panel.h), for the weight streams and the KV cache's rows alike: one switch, chosen at run
   time by timing the model's own forwards both ways (kernels/tune.py HintTrial). On Zen 5 t0 made
   qwen2.5-coder-1.5b's one-row forward 19.0 -> 17.0 ms, on Zen 4 it read the weight stream at 20.5
   GB/s instead of 29.9 (results_final/zen5_1206); attention alone on Zen 5 took 0.88-1.03 of its time
   under t1, most 0.94-0.99 (results_final/zen5_1206c/att_hint.txt). Prefetch moves no bits. */
static int ss_pf_t0 = 0;
/* on: 1 t0, 0 the default hints, -1 no change; returns the setting before the call */
SS_EXPORT int ss_set_prefetch_t0(int on) {
    const int was = ss_pf_t0;
    if (on >= 0) ss_pf_t0 = on != 0;
    return was;
}

/* prefetch the line at p: with prefetcht0 where the switch says so, else with locality DFLT */
#define SS_PREFETCH(p, DFLT) (ss_pf_t0 ? __builtin_prefetch((p), 0, 3) : __builtin_prefetch((p), 0, (DFLT)))

/* a KV row's line at p */
SS_INLINE void prefetch_line(const void *p) { SS_PREFETCH(p, ATT_PF_HINT); }

/* prefetch the n bytes at p */
SS_INLINE void prefetch_bytes(const void *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) prefetch_line((const char *)p + o);
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

