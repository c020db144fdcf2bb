/* Part of cpu_kernels.c (linear layers with float activations): not compiled alone, cpu_kernels.c includes it
 * in order (one translation unit; build.py hashes every csrc file). */

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

