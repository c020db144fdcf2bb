/* Part of cpu_kernels.c (paged attention: multi-vector dot products and value sums): not compiled alone, cpu_kernels.c includes it
 * in order (one translation unit; build.py hashes every csrc file). */

#define ATT_QV 4 /* query vectors per block of the multi-vector kernels */
#define ATT_QT 4 /* rows of one sequence per work item (with the heads of a kv head) */
#define ATT_VMAX 64 /* query vectors per work item at most (rows x heads) */
#ifndef ATT_PF_SPREAD
/* 1: an fp32 cache's rows prefetched a line at a time inside the multi-vector kernels' loops (K)
   and by the 64 dims each pass of the V sums reads; 0: each row's lines at once (an in-process
   A/B, decode_cost.py --variants). One row of qwen2.5-coder-1.5b at 2048 keys: attention 4.75 ms
   instead of 5.57 (results_final/zen5_1206c/att_prefetch.txt) */
#define ATT_PF_SPREAD 1
#endif
#ifndef ATT_PAIRS
#define ATT_PAIRS 1 /* AVX-512: the scores of two query vectors per register (dot8x8_pairs); 0: the AVX2
                       build's dot8x8_multi instead (an in-process A/B, decode_cost.py --variants) */
#endif
#if defined(SS_AVX512) && ATT_PAIRS
#define ATT_PAIR512 1
#endif

#ifdef SS_AVX2
/* out[v] = the 8 scores dot8x8(qv[v], kp) for v < NV: per (vector, key) the same lanes, FMAs
   and hsum8x8 as dot8x8; each K row load serves NV vectors */
SS_INLINE void dot8x8_multi(const int NV, const float *const *qv, const float *const *kp, int D, __m256 *out,
                            const float *const *pk) {
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
            if (pk && d % 16 == 0) /* (pk: see attn_scores_multi) */
                for (int j = h; j < h + 4; j++) prefetch_line(pk[j] + d);
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
/* hsum8x8 of the 8 keys held two per register (a[p] = [key 2p | key 2p + 1]): the same additions
   of the same pairs (fp addition commutes), with half the shuffles. 128-bit lanes: a[p] = [lo(2p),
   hi(2p), lo(2p + 1), hi(2p + 1)]; s(j) = lo(j) + hi(j) as in hsum8x8's first step. */
SS_INLINE __m256 hsum8x8_512(const __m512 a[4]) {
    const __m512 s0145 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[2], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(a[0], a[2], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 s2367 = _mm512_add_ps(_mm512_shuffle_f32x4(a[1], a[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(a[1], a[3], _MM_SHUFFLE(3, 1, 3, 1)));
    /* [s0, s1, s4, s5] and [s2, s3, s6, s7]: per lane the pairs of hsum8x8's second step */
    const __m512 q = _mm512_add_ps(_mm512_shuffle_ps(s0145, s2367, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(s0145, s2367, _MM_SHUFFLE(3, 2, 3, 2)));
    /* q = [q0 | q1] of hsum8x8 */
    const __m256 q0 = _mm512_castps512_ps256(q), q1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q), 1));
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(q0, q1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(q0, q1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

#ifdef ATT_PAIR512
/* vectors of one query tile (ATT_QB) for the pair kernel: two per 512-bit register, each pair's
   query packed once as [q_a(d .. d + 7) | q_b(d .. d + 7)] per 8 dims, zero past D (so the
   masked tail FMAs are dot8x8's: 0 * 0 added) */
#define ATT_QB 6
SS_INLINE void pack_pairs(const float *const *qv, int n, int D, float *qp) {
    const int D8 = (D + 7) / 8 * 8;
    for (int v = 0; v < (n + 1) / 2 * 2; v++) { /* an odd tile repeats its last vector */
        const float *q = qv[v < n ? v : n - 1];
        float *o = qp + (v / 2) * 2 * D8 + 8 * (v % 2);
        for (int d = 0; d < D8; d++) o[16 * (d / 8) + d % 8] = d < D ? q[d] : 0.0f;
    }
}
/* out[2p], out[2p + 1] = dot8x8 of the pair p's two vectors for NP pairs: each register holds both
   vectors' 8 lanes of one key (the key's 8 dims broadcast to both halves, no shuffle in the loop),
   the same FMAs per lane as dot8x8 and its hsum8x8 (as hsum8x8_512) per (vector, key) */
SS_INLINE void dot8x8_pairs(const int NP, const float *qp, const float *const *kp, int D, __m256 *out,
                            const float *const *pk) {
    const int D8 = (D + 7) / 8 * 8;
    __m512 a[ATT_QB / 2][8];
    for (int p = 0; p < NP; p++)
        for (int j = 0; j < 8; j++) a[p][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m512 q[ATT_QB / 2];
        for (int p = 0; p < NP; p++) q[p] = _mm512_loadu_ps(qp + p * 2 * D8 + 2 * d);
        if (d + 8 <= D) { /* a plain load broadcasts from memory; a masked one would need a shuffle */
            for (int j = 0; j < 8; j++) {
                const __m512 k = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(kp[j] + d))));
                for (int p = 0; p < NP; p++) a[p][j] = _mm512_fmadd_ps(q[p], k, a[p][j]);
            }
            if (pk && d % 16 == 0) /* (pk: see attn_scores_multi) */
                for (int j = 0; j < 8; j++) prefetch_line(pk[j] + d);
            continue;
        }
        const __mmask8 m = (__mmask8)((1u << (D - d)) - 1);
        for (int j = 0; j < 8; j++) {
            const __m512 k = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_maskz_loadu_ps(m, kp[j] + d))));
            for (int p = 0; p < NP; p++) a[p][j] = _mm512_fmadd_ps(q[p], k, a[p][j]);
        }
    }
    for (int p = 0; p < NP; p++) {
        __m512 lo[4], hi[4];
        for (int i = 0; i < 4; i++) {
            lo[i] = _mm512_shuffle_f32x4(a[p][2 * i], a[p][2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0));
            hi[i] = _mm512_shuffle_f32x4(a[p][2 * i], a[p][2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2));
        }
        out[2 * p] = hsum8x8_512(lo), out[2 * p + 1] = hsum8x8_512(hi);
    }
}
#else
#define ATT_QB ATT_QV
#endif

/* scores of nv vectors qs[v] over keys [0, L) (L % 8 == 0 on AVX2 builds) into scs[v], mx[v] updated:
   per (vector, key) exactly attn_scores' value */
static void attn_scores_multi(const float *const *qs, int nv, const float *kbase, const int64_t *koff, int64_t L,
                              int D, float scale, float softcap, float *const *scs, float *mx, int pf) {
#ifdef SS_AVX2
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int v0 = 0; v0 < nv; v0 += ATT_QB) {
        const int n = nv - v0 < ATT_QB ? nv - v0 : ATT_QB;
        __m256 vmx[ATT_QB]; /* without a softcap: each vector's running max, lane by lane (a max is exact in any order) */
        for (int w = 0; w < n; w++) vmx[w] = _mm256_set1_ps(mx[v0 + w]);
#ifdef ATT_PAIR512
        float qp[ATT_QB * ATT_DMAX] SS_ALIGN;
        if (n > 1) pack_pairs(qs + v0, n, D, qp);
#endif
        for (int64_t i = 0; i < L; i += 8) {
            const float *kp[8];
            for (int j = 0; j < 8; j++) kp[j] = kbase + koff[i + j];
            /* the rows ATT_PF keys ahead: the multi-vector kernels prefetch a line of each every 16
               dims (pk); all their lines at once, 8 x D / 16 of them, stalled on the miss queue */
            const float *pk[8];
            const int spread = ATT_PF_SPREAD && pf && v0 == 0 && n > 1;
            for (int j = 0; spread && j < 8; j++) pk[j] = i + ATT_PF + j < L ? kbase + koff[i + ATT_PF + j] : kp[j];
            for (int64_t j = i + ATT_PF; pf && !spread && v0 == 0 && j < i + ATT_PF + 8 && j < L; j++)
                prefetch_bytes(kbase + koff[j], 4 * D);
            const float *const *pp = spread ? pk : NULL;
            __m256 r[ATT_QB];
            switch (n) {
#ifdef ATT_PAIR512
            case 6: case 5: dot8x8_pairs(3, qp, kp, D, r, pp); break;
            case 4: case 3: dot8x8_pairs(2, qp, kp, D, r, pp); break;
            case 2: dot8x8_pairs(1, qp, kp, D, r, pp); break;
#else
            case 4: dot8x8_multi(4, qs + v0, kp, D, r, pp); break;
            case 3: dot8x8_multi(3, qs + v0, kp, D, r, pp); break;
            case 2: dot8x8_multi(2, qs + v0, kp, D, r, pp); break;
#endif
            default: r[0] = dot8x8(qs[v0], kp, D); break; /* 8 accumulator chains, not 4 */
            }
            if (softcap <= 0.0f) {
                for (int w = 0; w < n; w++) {
                    const __m256 x = _mm256_mul_ps(r[w], vscale);
                    _mm256_storeu_ps(scs[v0 + w] + i, x);
                    vmx[w] = _mm256_max_ps(x, vmx[w]); /* x NaN: keeps the max, as the scalar loop */
                }
                continue;
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
        for (int w = 0; softcap <= 0.0f && w < n; w++) {
            float m8[8] SS_ALIGN, m = mx[v0 + w];
            _mm256_store_ps(m8, vmx[w]);
            for (int j = 0; j < 8; j++) m = m8[j] > m ? m8[j] : m;
            mx[v0 + w] = m;
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
        __m512 a[ATT_QB][4];
        for (int v = 0; v < NV; v++)
            for (int c = 0; c < 4; c++) a[v][c] = _mm512_loadu_ps(acc[v] + d0 + 16 * c);
        for (int64_t i = 0; i < L; i++) {
            const float *vr = vbase + voff[i] + d0;
#if ATT_PF_SPREAD /* each pass the 64 dims it reads of the row ATT_PF keys ahead, not the whole row in the first */
            if (pf && i + ATT_PF < L) prefetch_bytes(vbase + voff[i + ATT_PF] + d0, 4 * (D - d0 < 64 ? D - d0 : 64));
#else
            if (pf && d0 == 0 && i + ATT_PF < L) prefetch_bytes(vbase + voff[i + ATT_PF], 4 * D);
#endif
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
        __m256 a[ATT_QB][2];
        for (int v = 0; v < NV; v++)
            for (int c = 0; c < 2; c++) a[v][c] = _mm256_loadu_ps(acc[v] + d0 + 8 * c);
        for (int64_t i = 0; i < L; i++) {
            const float *vr = vbase + voff[i] + d0;
#if ATT_PF_SPREAD
            if (pf && i + ATT_PF < L) prefetch_bytes(vbase + voff[i + ATT_PF] + d0, 4 * (D - d0 < 16 ? D - d0 : 16));
#else
            if (pf && d0 == 0 && i + ATT_PF < L) prefetch_bytes(vbase + voff[i + ATT_PF], 4 * D);
#endif
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
    for (int v0 = 0; v0 < nv; v0 += ATT_QB) {
        switch (nv - v0 < ATT_QB ? nv - v0 : ATT_QB) {
#if ATT_QB > 4
        case 6: values_multi(6, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        case 5: values_multi(5, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
#endif
        case 4: values_multi(4, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        case 3: values_multi(3, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        case 2: values_multi(2, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        default: values_multi(1, pw + v0, vbase, voff, L, D, acc + v0, pf); break;
        }
    }
}

