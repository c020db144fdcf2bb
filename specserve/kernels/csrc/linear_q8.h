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

#if defined(SS_AVX2)
/* with VNNI (no int16 saturation) signed weights are biased to unsigned
   bytes, w + 128, and the lane sums start from -128 S[l]; without it the
   activations take the weights' signs (maddubs would saturate) */
#if (defined(SS_AVX512) && defined(__AVX512VNNI__)) || (!defined(SS_AVX512) && defined(__AVXVNNI__))
#define QL_U8BIAS 1
#endif

/* ------------------------------------------------------------------------ */
/* weight unpacking (SIMD)                                                  */
/* ------------------------------------------------------------------------ */

/* 32 bytes of nibbles -> [low nibbles | high nibbles] */
SS_INLINE vi16 nibbles64(__m256i y) {
#if defined(SS_AVX512)
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1);
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
#else
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    return vi_from2(_mm256_and_si256(y, m4), _mm256_and_si256(_mm256_srli_epi16(y, 4), m4));
#endif
}

/* nibbles of two Q4 blocks (16 bytes each; qs1 NULL: zeros) in nibble order */
SS_INLINE vi16 q4_pair(const uint8_t *qs0, const uint8_t *qs1) {
    const __m128i a = _mm_loadu_si128((const __m128i *)qs0);
    const __m128i b = qs1 ? _mm_loadu_si128((const __m128i *)qs1) : _mm_setzero_si128();
    return nibbles64(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

/* f16 pairs at p0 and p1 (p1 NULL: zeros) -> [p0[0], p0[1], p1[0], p1[1]] */
SS_INLINE __m128 h4(const uint8_t *p0, const uint8_t *p1) {
    uint32_t a, b = 0;
    memcpy(&a, p0, 4);
    if (p1) memcpy(&b, p1, 4);
#ifdef SS_F16C
    return _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)b, (int)a));
#else
    const uint8_t z[4] = {0, 0, 0, 0};
    if (!p1) p1 = z;
    return _mm_setr_ps(h2f(p0), h2f(p0 + 2), h2f(p1), h2f(p1 + 2));
#endif
}

/* one pair of 32-blocks of a 32-value format, unpacked */
typedef struct {
    vi16 q; /* unsigned bytes: Q4 nibbles; Q8_0 / I8: w + 128 (QL_U8BIAS) or |w| */
    vi16 s; /* Q8_0 / I8 without QL_U8BIAS: signed weights (signs of the activations) */
    vf16 d, m;
} W32;

SS_INLINE W32 w32_prep(const int fmt, const uint8_t *row, int64_t p, const int tail) {
    W32 w;
    if (fmt == FMT_Q4_1) {
        const uint8_t *b0 = row + 2 * p * 20, *b1 = tail ? NULL : b0 + 20;
        w.q = q4_pair(b0 + 4, b1 ? b1 + 4 : NULL);
        const __m128 dm = h4(b0, b1);
        w.d = vf_perm4(dm, QL_IDX_NIB_D);
        w.m = vf_perm4(dm, QL_IDX_NIB_M);
        w.s = w.q;
    } else if (fmt == FMT_Q4_0) { /* nibbles; the -8 is in the lane sums' start value */
        const uint8_t *b0 = row + 2 * p * 18, *b1 = tail ? NULL : b0 + 18;
        w.q = w.s = q4_pair(b0 + 2, b1 ? b1 + 2 : NULL);
        w.d = vf_perm4(h4(b0, b1), QL_IDX_NIB_D);
        w.m = w.d;
    } else { /* Q8_0, I8: natural order */
        const uint8_t *q0, *q1;
        if (fmt == FMT_Q8_0) {
            const uint8_t *b0 = row + 2 * p * 34;
            q0 = b0 + 2;
            q1 = b0 + 36;
            w.d = vf_perm4(h4(b0, tail ? NULL : b0 + 34), QL_IDX_NAT_D);
        } else {
            q0 = row + 64 * p;
            q1 = q0 + 32;
            w.d = vf_set1(1.0f);
        }
        const __m256i lo = _mm256_loadu_si256((const __m256i *)q0);
        const __m256i hi = tail ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)q1);
        w.s = vi_from2(lo, hi);
#ifdef QL_U8BIAS
        w.q = vi_sub8(w.s, -128);
#else
        w.q = vi_abs8(w.s);
#endif
        w.m = w.d;
    }
    return w;
}

/* one pair of blocks for one (row, channel) */
SS_INLINE vf16 w32_step(const int fmt, const W32 *w, const uint8_t *xr, const QXLay *L, int64_t p, vf16 f,
                        const int tail) {
    const vi16 x = vi_load(xr + 64 * p);
    const vi16 xc = vi_load((const int32_t *)(xr + L->o_f2) + 16 * p);
    vi16 P;
    if (fmt == FMT_Q4_1) P = vi_dot4(vi_zero(), w->q, x);
    else if (fmt == FMT_Q4_0) P = vi_dot4(xc, w->q, x);
#ifdef QL_U8BIAS
    else P = vi_dot4(xc, w->q, x);
#else
    else P = vi_dot4(vi_zero(), w->q, vi_sign8(x, w->s));
#endif
    const vf16 dxv = vf_load((const float *)(xr + L->o_f1) + 16 * p);
    vf16 g = vf_fmadd(vf_cvt(P), fmt == FMT_I8 ? dxv : vf_mul(w->d, dxv), f);
    if (fmt == FMT_Q4_1) g = vf_fmadd(w->m, vf_load((const float *)(xr + L->o_f2) + 16 * p), g);
    if (tail) g = vf_blend(is_nibble_fmt(fmt) ? 0x0F0F : 0x00FF, f, g);
    return g;
}

/* R rows x C channels, whole K; acc[r * LIN_ACCS + c * 16 + lane].
   pf != 0: prefetch the same bytes pf further on (the next channel block),
   spread over the loop so that the misses overlap with the arithmetic */
SS_INLINE void q32_tile(const int fmt, const int R, const int C, const uint8_t *xb, const QXLay *L,
                        const uint8_t *const *rows, int64_t K, float *acc, int64_t pf) {
    vf16 f[QL_R][QL_C];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8")
        for (int c = 0; c < C; c++) f[r][c] = vf_zero();
    const int64_t nb = K / 32, np = nb / 2;
    const int64_t step = fmt == FMT_I8 ? 64 : 2 * (fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20);
    for (int64_t p = 0; p < np; p++) {
        _Pragma("GCC unroll 8")
        for (int c = 0; c < C; c++) {
            if (pf) __builtin_prefetch(rows[c] + pf + step * p, 0, QL_PF_HINT);
            const W32 w = w32_prep(fmt, rows[c], p, 0);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++) f[r][c] = w32_step(fmt, &w, xb + r * L->stride, L, p, f[r][c], 0);
        }
    }
    if (nb & 1) {
        _Pragma("GCC unroll 8")
        for (int c = 0; c < C; c++) {
            const W32 w = w32_prep(fmt, rows[c], np, 1);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++) f[r][c] = w32_step(fmt, &w, xb + r * L->stride, L, np, f[r][c], 1);
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8")
        for (int c = 0; c < C; c++) vf_store(acc + r * LIN_ACCS + c * 16, f[r][c]);
}

/* one super-block of a K-quant, unpacked */
typedef struct {
    vi16 q[4];  /* unsigned values of the 4 chunks of 64 */
    vi16 sc[4]; /* int16 scale of each int16 lane of the chunk */
    __m128i mn; /* Q4_K: 8 mins, int16 */
    vf16 d, dmin;
} WK;

/* Q4_K 6-bit scales and mins: bytes sc0..7 and m0..7 */
SS_INLINE void q4k_scales8(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t sc_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
    *sc = (uint64_t)(a & 0x3f3f3f3fu) | ((uint64_t)sc_hi << 32);
    *mn = (uint64_t)(b & 0x3f3f3f3fu) | ((uint64_t)mn_hi << 32);
}

SS_INLINE void wk_prep(const int fmt, const uint8_t *blk, WK *w) {
    if (fmt == FMT_Q4_K) {
        const __m128 dd = h4(blk, NULL);
        w->d = vf_perm4(dd, QL_IDX_ALL(0));
        w->dmin = vf_perm4(dd, QL_IDX_ALL(1));
        uint64_t sc, mn;
        q4k_scales8(blk + 4, &sc, &mn);
        w->mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
        const __m128i s8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc));
#if defined(SS_AVX512)
        /* int16 lanes 0..15 <- scale 2g, 16..31 <- scale 2g + 1 */
        const __m512i s = _mm512_castsi128_si512(s8);
        _Pragma("GCC unroll 4")
        for (int g = 0; g < 4; g++)
            w->sc[g] = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(2 * g)),
                                                                   _mm256_set1_epi16((short)(2 * g + 1)), 1), s);
#else
        const __m256i s2 = _mm256_broadcastsi128_si256(s8);
        const __m256i u0 = _mm256_unpacklo_epi16(s2, s2), u1 = _mm256_unpackhi_epi16(s2, s2);
        w->sc[0] = vi_from2(_mm256_shuffle_epi32(u0, 0x00), _mm256_shuffle_epi32(u0, 0x55));
        w->sc[1] = vi_from2(_mm256_shuffle_epi32(u0, 0xAA), _mm256_shuffle_epi32(u0, 0xFF));
        w->sc[2] = vi_from2(_mm256_shuffle_epi32(u1, 0x00), _mm256_shuffle_epi32(u1, 0x55));
        w->sc[3] = vi_from2(_mm256_shuffle_epi32(u1, 0xAA), _mm256_shuffle_epi32(u1, 0xFF));
#endif
        const uint8_t *qs = blk + 16;
        _Pragma("GCC unroll 4")
        for (int g = 0; g < 4; g++) w->q[g] = nibbles64(_mm256_loadu_si256((const __m256i *)(qs + 32 * g)));
        return;
    }
    /* Q6_K */
    w->d = vf_perm4(h4(blk + 208, NULL), QL_IDX_ALL(0));
    w->dmin = vf_zero();
    w->mn = _mm_setzero_si128();
    const __m256i t = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
#if defined(SS_AVX512)
    /* int16 lanes 8i .. 8i+7 <- scale 4g + i */
    const __m512i tz = _mm512_castsi256_si512(t);
    _Pragma("GCC unroll 4")
    for (int g = 0; g < 4; g++) {
        const __m256i lo = _mm256_set_m128i(_mm_set1_epi16((short)(4 * g + 1)), _mm_set1_epi16((short)(4 * g)));
        const __m256i hi = _mm256_set_m128i(_mm_set1_epi16((short)(4 * g + 3)), _mm_set1_epi16((short)(4 * g + 2)));
        w->sc[g] = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), tz);
    }
#else
    const __m256i u0 = _mm256_unpacklo_epi16(t, t), u1 = _mm256_unpackhi_epi16(t, t);
    const __m256i i01 = QL_I8_256(0, 1), i23 = QL_I8_256(2, 3), i45 = QL_I8_256(4, 5), i67 = QL_I8_256(6, 7);
    w->sc[0] = vi_from2(_mm256_permutevar8x32_epi32(u0, i01), _mm256_permutevar8x32_epi32(u0, i23));
    w->sc[1] = vi_from2(_mm256_permutevar8x32_epi32(u1, i01), _mm256_permutevar8x32_epi32(u1, i23));
    w->sc[2] = vi_from2(_mm256_permutevar8x32_epi32(u0, i45), _mm256_permutevar8x32_epi32(u0, i67));
    w->sc[3] = vi_from2(_mm256_permutevar8x32_epi32(u1, i45), _mm256_permutevar8x32_epi32(u1, i67));
#endif
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; h++) {
        const __m256i A = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        const __m256i B = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        w->q[2 * h] = vi_from2(
            _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m30)),
            _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m30)));
        w->q[2 * h + 1] = vi_from2(
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(H, m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(H, 2), m30)));
    }
}

SS_INLINE void qk_tile(const int fmt, const int R, const int C, const uint8_t *xb, const QXLay *L,
                       const uint8_t *const *rows, int64_t K, float *acc, int64_t pf) {
    vf16 f[QL_R][QL_C];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8")
        for (int c = 0; c < C; c++) f[r][c] = vf_zero();
    const int bb = fmt == FMT_Q4_K ? 144 : 210;
    for (int64_t s = 0; s < K / 256; s++) {
        _Pragma("GCC unroll 8")
        for (int c = 0; c < C; c++) {
            if (pf)
                for (int o = 0; o < bb; o += 64) __builtin_prefetch(rows[c] + pf + s * bb + o, 0, QL_PF_HINT);
            WK w;
            wk_prep(fmt, rows[c] + s * bb, &w);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++) {
                const uint8_t *xr = xb + r * L->stride;
                const int8_t *xq = (const int8_t *)xr + 256 * s;
                vi16 I = vi_zero();
                _Pragma("GCC unroll 8")
                for (int g = 0; g < 4; g++) {
                    vi16 p16 = vi_maddubs(w.q[g], vi_load(xq + 64 * g));
                    if (fmt == FMT_Q6_K) p16 = vi_sub16(p16, vi_load((const int16_t *)(xr + L->o_p32) + 128 * s + 32 * g));
                    I = vi_dot2(I, p16, w.sc[g]);
                }
                const vf16 dx = vf_load((const float *)(xr + L->o_f1) + 16 * s);
                f[r][c] = vf_fmadd(vf_cvt(I), vf_mul(w.d, dx), f[r][c]);
                if (fmt == FMT_Q4_K) {
                    const __m128i bs = _mm_loadu_si128((const __m128i *)((const int16_t *)(xr + L->o_bs) + 8 * s));
                    f[r][c] = vf_fnmadd_lo4(_mm_cvtepi32_ps(_mm_madd_epi16(w.mn, bs)), vf_mul(w.dmin, dx), f[r][c]);
                }
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8")
        for (int c = 0; c < C; c++) vf_store(acc + r * LIN_ACCS + c * 16, f[r][c]);
}

/* all rows [0, ms) x LIN_NB channels of one block; the first row tile
   prefetches the next block (pf bytes on, 0: none) */
SS_INLINE void ql_rows(const int fmt, int ms, const uint8_t *xb, const QXLay *L, const uint8_t *const *rows,
                       int64_t K, float *acc, int64_t pf) {
#define QL_TILE(R)                                                                                     \
    for (int c0 = 0; c0 < LIN_NB; c0 += QL_C) {                                                        \
        const int64_t pfm = m == 0 ? pf : 0;                                                           \
        if (is_k_fmt(fmt))                                                                             \
            qk_tile(fmt, R, QL_C, xb + m * L->stride, L, rows + c0, K, acc + m * LIN_ACCS + c0 * 16, pfm); \
        else                                                                                           \
            q32_tile(fmt, R, QL_C, xb + m * L->stride, L, rows + c0, K, acc + m * LIN_ACCS + c0 * 16, pfm); \
    }
    int m = 0;
    for (; m + QL_R <= ms; m += QL_R) {
        QL_TILE(QL_R)
    }
    switch (ms - m) { /* the rest, < QL_R rows */
#if QL_R > 7
    case 7: QL_TILE(7) break;
#endif
#if QL_R > 6
    case 6: QL_TILE(6) break;
#endif
#if QL_R > 5
    case 5: QL_TILE(5) break;
#endif
#if QL_R > 4
    case 4: QL_TILE(4) break;
#endif
#if QL_R > 3
    case 3: QL_TILE(3) break;
#endif
#if QL_R > 2
    case 2: QL_TILE(2) break;
#endif
    case 1: QL_TILE(1) break;
    default: break;
    }
#undef QL_TILE
}

static void ql_block(int fmt, int ms, const uint8_t *xb, const QXLay *L, const uint8_t *const *rows, int64_t K,
                     float *acc, int64_t pf) {
    switch (fmt) {
    case FMT_I8: ql_rows(FMT_I8, ms, xb, L, rows, K, acc, pf); break;
    case FMT_Q8_0: ql_rows(FMT_Q8_0, ms, xb, L, rows, K, acc, pf); break;
    case FMT_Q4_0: ql_rows(FMT_Q4_0, ms, xb, L, rows, K, acc, pf); break;
    case FMT_Q4_1: ql_rows(FMT_Q4_1, ms, xb, L, rows, K, acc, pf); break;
    case FMT_Q4_K: ql_rows(FMT_Q4_K, ms, xb, L, rows, K, acc, pf); break;
    case FMT_Q6_K: ql_rows(FMT_Q6_K, ms, xb, L, rows, K, acc, pf); break;
    default: break;
    }
}

#else /* scalar mirror */

/* unsigned or signed weight values of one 64-value step in lane order, and
   per-lane float scales (dw, m) */
static void w32_unpack_scalar(int fmt, const uint8_t *row, int64_t p, int two, int wq[64], float dw[16],
                              float mw[16]) {
    float d[2] = {0, 0}, m[2] = {0, 0};
    memset(wq, 0, 64 * sizeof(int));
    for (int b = 0; b < 1 + two; b++) {
        const int64_t blk = 2 * p + b;
        if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
            const int bb = fmt == FMT_Q4_0 ? 18 : 20, off = fmt == FMT_Q4_0 ? 8 : 0;
            const uint8_t *bp = row + blk * bb, *qs = bp + bb - 16;
            d[b] = h2f(bp);
            if (fmt == FMT_Q4_1) m[b] = h2f(bp + 2);
            for (int i = 0; i < 16; i++) {
                wq[16 * b + i] = (qs[i] & 15) - off;
                wq[32 + 16 * b + i] = (qs[i] >> 4) - off;
            }
        } else if (fmt == FMT_Q8_0) {
            const uint8_t *bp = row + blk * 34;
            d[b] = h2f(bp);
            for (int i = 0; i < 32; i++) wq[32 * b + i] = ((const int8_t *)(bp + 2))[i];
        } else {
            d[b] = 1.0f;
            for (int i = 0; i < 32; i++) wq[32 * b + i] = ((const int8_t *)row)[32 * blk + i];
        }
    }
    for (int l = 0; l < 16; l++) {
        const int b = is_nibble_fmt(fmt) ? (l >> 2) & 1 : l >> 3;
        dw[l] = d[b];
        mw[l] = m[b];
    }
}

static void q32_dot_scalar(int fmt, const uint8_t *xr, const QXLay *L, const uint8_t *row, int64_t K, float f[16]) {
    const int64_t nb = K / 32;
    const int8_t *xq = (const int8_t *)xr;
    const float *dxv = (const float *)(xr + L->o_f1), *sxv = (const float *)(xr + L->o_f2);
    for (int64_t p = 0; p < L->nstep; p++) {
        const int two = 2 * p + 1 < nb;
        int wq[64];
        float dw[16], mw[16];
        w32_unpack_scalar(fmt, row, p, two, wq, dw, mw);
        for (int l = 0; l < 16; l++) {
            const int b = is_nibble_fmt(fmt) ? (l >> 2) & 1 : l >> 3;
            if (b == 1 && !two) continue;
            int P = 0;
            for (int i = 0; i < 4; i++) P += wq[4 * l + i] * xq[64 * p + 4 * l + i];
            const float dx = dxv[16 * p + l];
            f[l] = fmaf((float)P, fmt == FMT_I8 ? dx : dw[l] * dx, f[l]);
            if (fmt == FMT_Q4_1) f[l] = fmaf(mw[l], sxv[16 * p + l], f[l]);
        }
    }
}

static void qk_dot_scalar(int fmt, const uint8_t *xr, const QXLay *L, const uint8_t *row, int64_t K, float f[16]) {
    const int8_t *xq = (const int8_t *)xr;
    const float *dxs = (const float *)(xr + L->o_f1);
    const int16_t *bs = (const int16_t *)(xr + L->o_bs);
    for (int64_t s = 0; s < K / 256; s++) {
        int wq[256], sc[256], mn[8] = {0};
        float d, dmin = 0.0f;
        if (fmt == FMT_Q4_K) {
            const uint8_t *blk = row + s * 144, *qs = blk + 16;
            d = h2f(blk);
            dmin = h2f(blk + 2);
            for (int j = 0; j < 8; j++) {
                int scj, mj;
                q4k_scale_min(j, blk + 4, &scj, &mj);
                mn[j] = mj;
                for (int i = 0; i < 32; i++) sc[32 * j + i] = scj;
            }
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++) {
                    wq[64 * g + l] = qs[32 * g + l] & 15;
                    wq[64 * g + 32 + l] = qs[32 * g + l] >> 4;
                }
        } else {
            const uint8_t *blk = row + s * 210;
            d = h2f(blk + 208);
            for (int e = 0; e < 256; e++) sc[e] = ((const int8_t *)(blk + 192))[e / 16];
            for (int h = 0; h < 2; h++) {
                const uint8_t *pl = blk + 64 * h, *ph = blk + 128 + 32 * h;
                for (int l = 0; l < 32; l++) {
                    wq[128 * h + l] = ((pl[l] & 15) | (((ph[l] >> 0) & 3) << 4)) - 32;
                    wq[128 * h + l + 32] = ((pl[l + 32] & 15) | (((ph[l] >> 2) & 3) << 4)) - 32;
                    wq[128 * h + l + 64] = ((pl[l] >> 4) | (((ph[l] >> 4) & 3) << 4)) - 32;
                    wq[128 * h + l + 96] = ((pl[l + 32] >> 4) | (((ph[l] >> 6) & 3) << 4)) - 32;
                }
            }
        }
        int I[16] = {0};
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 16; l++)
                for (int i = 0; i < 4; i++) {
                    const int e = 64 * g + 4 * l + i;
                    I[l] += sc[e] * wq[e] * xq[256 * s + e];
                }
        const float dx = dxs[16 * s]; /* the 16 copies are equal */
        for (int l = 0; l < 16; l++) f[l] = fmaf(d * dx, (float)I[l], f[l]);
        if (fmt == FMT_Q4_K)
            for (int i = 0; i < 4; i++) {
                const int Mn = mn[2 * i] * bs[8 * s + 2 * i] + mn[2 * i + 1] * bs[8 * s + 2 * i + 1];
                f[i] = fmaf(-(dmin * dx), (float)Mn, f[i]);
            }
    }
}

static void ql_block(int fmt, int ms, const uint8_t *xb, const QXLay *L, const uint8_t *const *rows, int64_t K,
                     float *acc, int64_t pf) {
    (void)pf;
    for (int m = 0; m < ms; m++)
        for (int j = 0; j < LIN_NB; j++) {
            float *f = acc + m * LIN_ACCS + j * 16;
            for (int l = 0; l < 16; l++) f[l] = 0.0f;
            if (is_k_fmt(fmt)) qk_dot_scalar(fmt, xb + m * L->stride, L, rows[j], K, f);
            else q32_dot_scalar(fmt, xb + m * L->stride, L, rows[j], K, f);
        }
}
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

/* out[n0 .. n0+nb) of row m from the lane accumulators of LIN_NB channels */
SS_INLINE void ql_epilogue(const float *a, int nb, int fmt, const float *scale, const float *bias, int64_t n0,
                           float *o) {
    float s[LIN_NB] SS_ALIGN;
#if defined(SS_AVX2)
    __m256 t[8];
    for (int j = 0; j < 8; j++) t[j] = _mm256_add_ps(_mm256_load_ps(a + 16 * j), _mm256_load_ps(a + 16 * j + 8));
    _mm256_store_ps(s, hsum8x8(t)); /* s[j] = hsum16(a + 16 j) */
#else
    for (int j = 0; j < LIN_NB; j++) s[j] = hsum16(a + 16 * j);
#endif
    if (fmt == FMT_I8)
        for (int j = 0; j < nb; j++) s[j] = s[j] * scale[n0 + j];
    if (bias != NULL)
        for (int j = 0; j < nb; j++) s[j] = s[j] + bias[n0 + j];
    memcpy(o, s, sizeof(float) * (size_t)nb);
}

/*
 * out[M, N] = x[M, K] @ W[N, K]^T (* scale) (+ bias), activations quantized
 * to int8 (see the top of this file). Same arguments as ss_linear; formats
 * I8 (K % 32 == 0), Q8_0, Q4_0, Q4_1, Q4_K, Q6_K.
 */
SS_EXPORT int ss_linear_q8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int fmt,
                           int64_t row_bytes, const float *scale, const float *bias, float *out, int64_t N,
                           int64_t ldo, int nthreads) {
    int be, bb;
    if (fmt == FMT_F32 || fmt_block(fmt, &be, &bb) != 0) return SS_EFORMAT;
    if (M < 0 || N < 0 || K <= 0 || ldx < K || ldo < N) return SS_EINVAL;
    if (K % (is_k_fmt(fmt) ? 256 : 32) != 0 || row_bytes < (K / be) * bb) return SS_EINVAL;
    if (fmt == FMT_I8 && scale == NULL) return SS_EINVAL;
    if (M == 0 || N == 0) return SS_OK;
    nthreads = resolve_threads(nthreads);
    QXLay L;
    qx_layout(fmt, K, &L);
    uint8_t *xb = (uint8_t *)aligned_alloc(64, (size_t)(M * L.stride));
    if (!xb) return SS_ENOMEM;
    const uint8_t *wb = (const uint8_t *)w;
    const int64_t nblocks = (N + LIN_NB - 1) / LIN_NB;
    const int par = nthreads > 1 && (double)M * (double)N * (double)K > 200000.0 && nblocks > 1;
    const int64_t pfb = (QL_PF_BYTES + LIN_NB * row_bytes - 1) / (LIN_NB * row_bytes);
    /* prefetch: the whole block at once for the 8-bit formats when a block
       is small (little arithmetic per byte: the misses must be in flight
       together), else spread over the block's loop (measured on Zen 5) */
    const int burst = (fmt == FMT_I8 || fmt == FMT_Q8_0) && LIN_NB * row_bytes <= 16384;

#pragma omp parallel num_threads(nthreads) if (par)
    {
        float acc[QL_MS * LIN_ACCS] SS_ALIGN;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) qx_row(fmt, x + m * ldx, K, xb + m * L.stride, &L);
        for (int64_t m0 = 0; m0 < M; m0 += QL_MS) {
            const int ms = (int)(M - m0 < QL_MS ? M - m0 : QL_MS);
#pragma omp for schedule(static) nowait
            for (int64_t blk = 0; blk < nblocks; blk++) {
                const int64_t n0 = blk * LIN_NB;
                const int nb = (int)(N - n0 < LIN_NB ? N - n0 : LIN_NB);
                const uint8_t *rows[LIN_NB];
                /* channels past N reuse channel n0 (results discarded) */
                for (int j = 0; j < LIN_NB; j++) rows[j] = wb + (n0 + (j < nb ? j : 0)) * row_bytes;
                /* the next block's rows, while they exist (weights stream from memory) */
                const int64_t pf = n0 + (pfb + 1) * LIN_NB <= N ? pfb * LIN_NB * row_bytes : 0;
                if (burst && pf) {
                    const uint8_t *pp = wb + n0 * row_bytes + pf, *pe = pp + LIN_NB * row_bytes;
                    for (; pp < pe; pp += 64) __builtin_prefetch(pp, 0, QL_PF_HINT);
                }
                ql_block(fmt, ms, xb + m0 * L.stride, &L, rows, K, acc, burst ? 0 : pf);
                for (int m = 0; m < ms; m++)
                    ql_epilogue(acc + m * LIN_ACCS, nb, fmt, scale, bias, n0, out + (m0 + m) * ldo + n0);
            }
        }
    }
    free(xb);
    return SS_OK;
}
