/* Part of cpu_kernels.c (dequantization of a chunk of one weight row): not compiled alone, cpu_kernels.c includes it
 * in order (one translation unit; build.py hashes every csrc file). */

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

/* Q5_0 (22 bytes: d, 32 high bits, 16 bytes of nibbles) and Q5_1 (24: d, m, ...), as gguf-py:
   q = low nibble (elements 0-15) or high nibble (16-31) | bit i of the high bits << 4;
   Q5_0: d * (float)(q - 16), Q5_1: d * (float)q + m (a product, then a sum) */
static void deq_q5(int with_min, const uint8_t *blk, int nblk, float *out) {
    const int bb = with_min ? 24 : 22;
    for (int b = 0; b < nblk; b++, blk += bb, out += 32) {
        const float d = h2f(blk), m = with_min ? h2f(blk + 2) : 0.0f;
        const uint8_t *qhp = blk + (with_min ? 4 : 2), *qs = qhp + 4;
        const uint32_t qh = (uint32_t)qhp[0] | (uint32_t)qhp[1] << 8 | (uint32_t)qhp[2] << 16 | (uint32_t)qhp[3] << 24;
        for (int i = 0; i < 32; i++) {
            const int q = ((i < 16 ? qs[i] : qs[i - 16] >> 4) & 0x0F) | (int)((qh >> i) & 1u) << 4;
            out[i] = with_min ? d * (float)q + m : d * (float)(q - 16);
        }
    }
}

/* Q5_K (176 bytes: d, dmin, 12 bytes of 6-bit scales and mins as Q4_K's, 32 bytes of high bits,
   128 of nibbles), as gguf-py: sub-block s (32 values) takes the low (even s) or high nibbles of
   bytes 32 (s / 2) .. + 31 and bit s of the high-bit bytes; (d * sc) * q - dmin * m */
static void deq_q5_k(const uint8_t *blk, int nblk, float *out) {
    for (int b = 0; b < nblk; b++, blk += 176, out += 256) {
        const float d = h2f(blk), dmin = h2f(blk + 2);
        const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + 48;
        for (int s = 0; s < 8; s++) {
            int sc, mi;
            q4k_scale_min(s, scales, &sc, &mi);
            const float ds = d * (float)sc, dm = dmin * (float)mi;
            const uint8_t *q = qs + 32 * (s / 2);
            for (int l = 0; l < 32; l++) {
                const int v = ((q[l] >> (4 * (s & 1))) & 0x0F) | ((qh[l] >> s) & 1) << 4;
                out[32 * s + l] = ds * (float)v - dm;
            }
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
    case FMT_Q5_0: *block_elems = 32; *block_bytes = 22; return 0;
    case FMT_Q5_1: *block_elems = 32; *block_bytes = 24; return 0;
    case FMT_Q5_K: *block_elems = 256; *block_bytes = 176; return 0;
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
    case FMT_Q5_0: deq_q5(0, row + (k0 / 32) * 22, kc / 32, out); break;
    case FMT_Q5_1: deq_q5(1, row + (k0 / 32) * 24, kc / 32, out); break;
    case FMT_Q5_K: deq_q5_k(row + (k0 / 256) * 176, kc / 256, out); break;
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

