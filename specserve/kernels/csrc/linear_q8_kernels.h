/* Part of linear_q8.h (the integer-dot microkernels per ISA and the entry points): included
 * at its end, not on its own. */

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
