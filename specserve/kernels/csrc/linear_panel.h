/*
 * Integer-dot linear over panel-packed I8 / Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights
 * (panel_pack.c has the layouts).  Included by cpu_kernels.c after
 * panel_pack.c; uses the vi16 / vf16 vectors of linear_q8.h.
 *
 * The activations are quantized to int8 as for ss_linear_q8 (per block of
 * 32 values for I8 / Q8_0 / Q4_0 / Q4_1, 256 for the K-quants).  Arithmetic of one
 * output (m, n), fixed by K alone: one float f from +0, then per weight block
 * in K order (every integer below is exact int32):
 *   Q8_0: S = sum w * q; f = fmaf((float)S, d * dx, f)
 *   Q4_1: S = sum w * q (w the nibbles);
 *         f = fmaf((float)S, d * dx, f); f = fmaf(m, dx * (float)Sq, f)
 *         (Sq: sum of the block's q)
 *   Q4_K: I = sum_j sc_j * S_j, Mn = sum_j mn_j * Sq_j over the 8
 *         sub-blocks of 32;
 *         f = fmaf((float)I, d * dx, f); f = fmaf(-(dmin * dx), (float)Mn, f)
 *   Q6_K: I = sum_u sc_u * (sum (w + 32) * q - 32 Sq_u) over the 16
 *         sub-blocks of 16; f = fmaf((float)I, d * dx, f)
 *   I8: as Q8_0 with f = fmaf((float)S, dx, f), and out = f * scale[n]
 *   Q4_0: as Q4_1 with w = nibble - 8 and no m term
 * out = f (+ bias[n]).  The vector paths hold 16 channels of one row in one
 * vector (no sum across lanes) and the scalar path does the same operations
 * per channel, so every build gives the same bits, for any number of rows
 * and threads.
 */

#ifndef QP_PF_BYTES
#define QP_PF_BYTES 16384 /* software prefetch distance in a panel stream */
#endif
/* the lines of [p + QP_PF_BYTES, + n) into L2, a few per step of the loops: panels stream from
   memory, and the hardware prefetchers alone were measured to leave a third of the bandwidth
   unused (Xeon, weights larger than its 300 MB last-level cache). 16 KiB ahead rather than 8:
   with 8 rows a panel takes 8 times the arithmetic per byte, and the shorter lead left the
   stream waiting (qwen2.5-coder-1.5b, 8 rows: 77-79 ms instead of 84-88, one row the same) */
#ifndef QP_PF_HINT
#define QP_PF_HINT 2 /* __builtin_prefetch's locality: 3 prefetcht0, 2 t1, 1 t2, 0 nta */
#endif
/* prefetcht0 instead of QP_PF_HINT where the run-time switch says so (ss_set_prefetch_t0, kv_formats.c) */
SS_INLINE void pq_prefetch(const uint8_t *p, int n) {
#if QP_PF_BYTES > 0 /* 0: no software prefetch */
    for (int o = 0; o < n; o += 64) SS_PREFETCH(p + QP_PF_BYTES + o, QP_PF_HINT);
#else
    (void)p, (void)n;
#endif
}

#ifndef QP_SINGLE_ROWS
/* one weight stream per thread: qwen2.5-coder-1.5b's forward at 1 row 31.2 ms instead of 38.3, at
   8 rows 49.4 instead of 58.0, at 16 rows 93.1 instead of 96.7 (Zen 5, 2 threads,
   benchmarks/decode_cost.py --variants, results_final/zen5_1203); prefill-sized calls keep the pairs */
#define QP_SINGLE_ROWS 16
#endif

#if defined(SS_AVX2)
/* rows per pass: QP_R over one panel (calls of up to QP_SINGLE_ROWS rows, verification-sized),
   QP_R2 over a pair of panels (prefill-sized). One pass for all rows of a verification: a 9-row
   call in passes of 8 + 1 re-ran the whole unpacking for the ninth row; qwen2.5-coder-1.5b's
   9-row forward 70.4 ms instead of 77.8 (Zen 4, results_final/zen4_1203/rows_per_pass_variants.md) */
#if defined(SS_AVX512)
#ifndef QP_R
/* 12, not 16: 16 rows in one pass were slower than passes of 8 (gemma3-270m, 16 rows: 32.6 vs
   28.4 ms; 12 rows within 3% of 8 or better, same file) */
#define QP_R 12
#endif
#define QP_R2 8
#define QP_R41 4
#else
#ifndef QP_R
#define QP_R 4 /* of 16 registers */
#endif
#define QP_R2 2
#define QP_R41 2
#endif

/* S += sum of the 4-byte products of signed weight bytes w and activation bytes x: with
   VNNI the weights are biased to unsigned (w ^ 0x80 = w + 128, prepared once as wu) and S
   starts from -128 sum(q); without it |w| * (x with the sign of w) (maddubs cannot saturate) */
SS_INLINE vi16 vi_dot4_signed(vi16 S, vi16 wu, vi16 w, vi16 x) {
#ifdef QL_U8BIAS
    (void)w;
    return vi_dot4(S, wu, x);
#else
    return vi_dot4(S, wu, vi_sign8(x, w));
#endif
}

/* T += w . x for unsigned 4- or 6-bit weights w: int32 dot products, or with QL_I16ACC int16 pair
   sums (linear_q8.h: the callers widen them within the bounds given there) */
SS_INLINE vi16 vi_acc(vi16 T, vi16 w, vi16 x) {
#ifdef QL_I16ACC
    return vi_add16(T, vi_dot2(w, x));
#else
    return vi_dot4(T, w, x);
#endif
}
/* an accumulator's first value for int32 sums that start at S0: S0, or with QL_I16ACC zero (S0 is
   added when the int16 sums are widened, vi_acc_end) */
SS_INLINE vi16 vi_acc_start(vi16 S0) {
#ifdef QL_I16ACC
    (void)S0;
    return vi_zero();
#else
    return S0;
#endif
}
/* the int32 sums of accumulator T, which started at vi_acc_start(S0) */
SS_INLINE vi16 vi_acc_end(vi16 S0, vi16 T) {
#ifdef QL_I16ACC
    return vi_add32(S0, vi_madd16(T, vi_set16(1)));
#else
    (void)S0;
    return T;
#endif
}

/* S[h][r] += w[h] . (the activation word at byte xo of row r), R rows x NP panels (vi_acc) */
SS_INLINE void pq_dot_rows(const int R, const int NP, const uint8_t *xb, const PXLay *L, int64_t xo, const vi16 *w,
                           vi16 S[2][QP_R]) {
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) {
        const vi16 x = vi_bcast32(xb + r * L->stride + xo);
        _Pragma("GCC unroll 2")
        for (int h = 0; h < NP; h++) S[h][r] = vi_acc(S[h][r], w[h], x);
    }
}

/* Ia[h][r] += S[h][r] * (the 16 channels' sub-block scales sc[h]), int32 lanes */
SS_INLINE void pq_scale_add32(const int R, const int NP, int32_t *Ia, vi16 S[2][QP_R], const vi16 *sc) {
    _Pragma("GCC unroll 2")
    for (int h = 0; h < NP; h++)
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            int32_t *ia = Ia + 16 * (h * QP_R + r);
            vi_store(ia, vi_add32(vi_load(ia), vi_mul32(S[h][r], sc[h])));
        }
}

/* the same for accumulators of vi_acc: with QL_I16ACC S holds int16 pair sums, and one madd with
   each scale in both halves of its lane widens and scales them */
SS_INLINE void pq_scale_add(const int R, const int NP, int32_t *Ia, vi16 S[2][QP_R], const vi16 *sc) {
#ifdef QL_I16ACC
    _Pragma("GCC unroll 2")
    for (int h = 0; h < NP; h++) {
        const vi16 s2 = vi_dup16(sc[h]);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            int32_t *ia = Ia + 16 * (h * QP_R + r);
            vi_store(ia, vi_add32(vi_load(ia), vi_madd16(S[h][r], s2)));
        }
    }
#else
    pq_scale_add32(R, NP, Ia, S, sc);
#endif
}

/* I8 (fmt FMT_I8: no block scale, f = fmaf((float)S, dx, f)) and Q8_0 */
SS_INLINE void pq_q8x(const int fmt, const int R, const int NP, const uint8_t *xb, const PXLay *L, const uint8_t *pp,
                      int64_t ps, int64_t K, float *out) {
    const int bb = fmt == FMT_I8 ? 512 : 544;
    _Pragma("GCC unroll 16")
    for (int i = 0; i < NP * QP_R; i++) vf_store(out + 16 * i, vf_zero());
    for (int64_t b = 0; b < K / 32; b++) {
        vi16 S[2][QP_R];
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
#ifdef QL_U8BIAS
            const vi16 c0 = vi_bcast32((const int32_t *)(xb + r * L->stride + L->o_aux) + b);
#else
            const vi16 c0 = vi_zero();
#endif
            _Pragma("GCC unroll 2")
            for (int h = 0; h < NP; h++) S[h][r] = c0;
        }
        _Pragma("GCC unroll 2")
        for (int h = 0; h < NP; h++) pq_prefetch(pp + h * ps + bb * b, bb);
        _Pragma("GCC unroll 8")
        for (int c = 0; c < 8; c++) {
            vi16 w[2], wu[2];
            _Pragma("GCC unroll 2")
            for (int h = 0; h < NP; h++) {
                w[h] = vi_load(pp + h * ps + bb * b + 64 * c);
#ifdef QL_U8BIAS
                wu[h] = vi_sub8(w[h], -128);
#else
                wu[h] = vi_abs8(w[h]);
#endif
            }
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                const vi16 x = vi_bcast32((const int8_t *)(xb + r * L->stride) + 32 * b + 4 * c);
                _Pragma("GCC unroll 2")
                for (int h = 0; h < NP; h++) S[h][r] = vi_dot4_signed(S[h][r], wu[h], w[h], x);
            }
        }
        _Pragma("GCC unroll 2")
        for (int h = 0; h < NP; h++) {
            const vf16 d = fmt == FMT_I8 ? vf_zero() : vf_h16(pp + h * ps + bb * b + 512);
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                const vf16 dx = vf_set1(((const float *)(xb + r * L->stride + L->o_dx))[b]);
                float *o = out + 16 * (h * QP_R + r);
                vf_store(o, vf_fmadd(vf_cvt(S[h][r]), fmt == FMT_I8 ? dx : vf_mul(d, dx), vf_load(o)));
            }
        }
    }
}

/* the int32 sums' start for block b of a row's activation record xr: Q4_0's -8 of the nibbles
   (-8 sum q, precomputed), else 0 */
SS_INLINE vi16 pq_q4x_start(const int fmt, const uint8_t *xr, const PXLay *L, int64_t b) {
    return fmt == FMT_Q4_0 ? vi_bcast32((const int32_t *)(xr + L->o_aux) + b) : vi_zero();
}

/* Q4_0 / Q4_1 have a float update per 32 values: their row tile is at most 4 rows (QP_R41), with the
   float accumulators of 4 rows x 2 panels in registers */
SS_INLINE void pq_q4x(const int fmt, const int R, const int NP, const uint8_t *xb, const PXLay *L, const uint8_t *pp,
                      int64_t ps, int64_t K, float *out) {
    const int bb = fmt == FMT_Q4_0 ? 288 : 320;
    const vi16 m4 = vi_set8(0x0F);
    vf16 f[2][QP_R41];
    _Pragma("GCC unroll 2")
    for (int h = 0; h < NP; h++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) f[h][r] = vf_zero();
    for (int64_t b = 0; b < K / 32; b++) {
        vi16 S[2][QP_R41];
        _Pragma("GCC unroll 2")
        for (int h = 0; h < NP; h++) {
            pq_prefetch(pp + h * ps + bb * b, bb);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) S[h][r] = vi_acc_start(pq_q4x_start(fmt, xb + r * L->stride, L, b));
        }
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            vi16 lo[2], hi[2];
            _Pragma("GCC unroll 2")
            for (int h = 0; h < NP; h++) {
                const vi16 raw = vi_load(pp + h * ps + bb * b + 64 * c);
                lo[h] = vi_and(raw, m4);
                hi[h] = vi_and(vi_srl16(raw, 4), m4);
            }
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                const int8_t *xq = (const int8_t *)(xb + r * L->stride) + 32 * b + 4 * c;
                const vi16 xl = vi_bcast32(xq), xh = vi_bcast32(xq + 16);
                _Pragma("GCC unroll 2")
                for (int h = 0; h < NP; h++) S[h][r] = vi_acc(vi_acc(S[h][r], lo[h], xl), hi[h], xh);
            }
        }
        _Pragma("GCC unroll 2")
        for (int h = 0; h < NP; h++) {
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) S[h][r] = vi_acc_end(pq_q4x_start(fmt, xb + r * L->stride, L, b), S[h][r]);
        }
        _Pragma("GCC unroll 2")
        for (int h = 0; h < NP; h++) {
            const uint8_t *pb = pp + h * ps + bb * b;
            const vf16 d = vf_h16(pb + 256), m = fmt == FMT_Q4_1 ? vf_h16(pb + 288) : vf_zero();
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                const uint8_t *xr = xb + r * L->stride;
                f[h][r] = vf_fmadd(vf_cvt(S[h][r]), vf_mul(d, vf_set1(((const float *)(xr + L->o_dx))[b])), f[h][r]);
                if (fmt == FMT_Q4_1) f[h][r] = vf_fmadd(m, vf_set1(((const float *)(xr + L->o_aux))[b]), f[h][r]);
            }
        }
    }
    _Pragma("GCC unroll 2")
    for (int h = 0; h < NP; h++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) vf_store(out + 16 * (h * QP_R + r), f[h][r]);
}

SS_INLINE void pq_q4k(const int fmt, const int R, const int NP, const uint8_t *xb, const PXLay *L, const uint8_t *pp,
                      int64_t ps, int64_t K, float *out) {
    (void)fmt;
    const vi16 m4 = vi_set8(0x0F);
    int32_t Ia[2 * QP_R * 16] SS_ALIGN;
    _Pragma("GCC unroll 16")
    for (int i = 0; i < NP * QP_R; i++) vf_store(out + 16 * i, vf_zero());
    for (int64_t s = 0; s < K / 256; s++) {
        _Pragma("GCC unroll 16")
        for (int i = 0; i < NP * QP_R; i++) vi_store(Ia + 16 * i, vi_zero());
        for (int j = 0; j < 8; j++) { /* sub-block j: low (even j) or high nibbles of chunks 8 (j / 2) .. +7 */
            if (!(j & 1)) /* the prefetches spread over the block: a quarter of its 37 lines per pair of sub-blocks */
                for (int h = 0; h < NP; h++) pq_prefetch(pp + h * ps + 2368 * s + 640 * (j / 2), j == 6 ? 448 : 640);
            vi16 S[2][QP_R];
            _Pragma("GCC unroll 2")
            for (int h = 0; h < NP; h++)
                _Pragma("GCC unroll 16")
                for (int r = 0; r < R; r++) S[h][r] = vi_zero();
            _Pragma("GCC unroll 8")
            for (int c = 0; c < 8; c++) {
                vi16 w[2];
                _Pragma("GCC unroll 2")
                for (int h = 0; h < NP; h++) {
                    const vi16 raw = vi_load(pp + h * ps + 2368 * s + 64 * (8 * (j / 2) + c));
                    w[h] = (j & 1) ? vi_and(vi_srl16(raw, 4), m4) : vi_and(raw, m4);
                }
                pq_dot_rows(R, NP, xb, L, 256 * s + 32 * j + 4 * c, w, S);
            }
            vi16 sc[2];
            _Pragma("GCC unroll 2")
            for (int h = 0; h < NP; h++) sc[h] = vi_u8(pp + h * ps + 2368 * s + 2048 + 16 * j);
            pq_scale_add(R, NP, Ia, S, sc);
        }
        _Pragma("GCC unroll 2")
        for (int h = 0; h < NP; h++) {
            const uint8_t *pb = pp + h * ps + 2368 * s;
            const vi16 mn0 = vi_load(pb + 2176), mn1 = vi_load(pb + 2240);
            const vf16 d = vf_h16(pb + 2304), dmin = vf_h16(pb + 2336);
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                const uint8_t *xr = xb + r * L->stride;
                const uint8_t *hl = xr + L->o_aux + 16 * s;
                const vi16 hi = vi_dot4(vi_dot4(vi_zero(), mn0, vi_bcast32(hl)), mn1, vi_bcast32(hl + 4));
                const vi16 lo = vi_dot4(vi_dot4(vi_zero(), mn0, vi_bcast32(hl + 8)), mn1, vi_bcast32(hl + 12));
                const vi16 Mn = vi_add32(vi_sll32(hi, 6), lo);
                const vf16 dx = vf_set1(((const float *)(xr + L->o_dx))[s]);
                float *o = out + 16 * (h * QP_R + r);
                const vf16 f = vf_fmadd(vf_cvt(vi_load(Ia + 16 * (h * QP_R + r))), vf_mul(d, dx), vf_load(o));
                vf_store(o, vf_fnmadd(vf_cvt(Mn), vf_mul(dmin, dx), f));
            }
        }
    }
}

/* Q6_K's int32 sums' start for sub-block u of super-block s: -32 sum q (the values are w + 32) */
SS_INLINE vi16 pq_q6k_start(const uint8_t *xr, const PXLay *L, int64_t s, int u) {
    return vi_bcast32((const int32_t *)(xr + L->o_aux) + 16 * s + u);
}

SS_INLINE void pq_q6k(const int fmt, const int R, const int NP, const uint8_t *xb, const PXLay *L, const uint8_t *pp,
                      int64_t ps, int64_t K, float *out) {
    (void)fmt;
    const vi16 m4 = vi_set8(0x0F), m30 = vi_set8(0x30);
    int32_t Ia[2 * QP_R * 16] SS_ALIGN;
    _Pragma("GCC unroll 16")
    for (int i = 0; i < NP * QP_R; i++) vf_store(out + 16 * i, vf_zero());
    for (int64_t s = 0; s < K / 256; s++) {
        _Pragma("GCC unroll 16")
        for (int i = 0; i < NP * QP_R; i++) vi_store(Ia + 16 * i, vi_zero());
        for (int u = 0; u < 16; u++) {
            if (u < 14) /* the block's 53 lines, 4 per sub-block */
                for (int h = 0; h < NP; h++) pq_prefetch(pp + h * ps + 3360 * s + 256 * u, u < 13 ? 256 : 32);
            vi16 sc[2];
            _Pragma("GCC unroll 2")
            for (int h = 0; h < NP; h++) sc[h] = vi_s8(pp + h * ps + 3360 * s + 3072 + 16 * u);
            vi16 S[2][QP_R];
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                const vi16 c0 = vi_acc_start(pq_q6k_start(xb + r * L->stride, L, s, u));
                _Pragma("GCC unroll 2")
                for (int h = 0; h < NP; h++) S[h][r] = c0;
            }
            _Pragma("GCC unroll 4")
            for (int j = 0; j < 4; j++) { /* values 16u + 4j .. +3 */
                vi16 v[2];
                _Pragma("GCC unroll 2")
                for (int h = 0; h < NP; h++) {
                    const uint8_t *pb = pp + h * ps + 3360 * s;
                    const vi16 q = vi_load(pb + 128 * u + 64 * (j >> 1)), hb = vi_load(pb + 2048 + 64 * u);
                    const vi16 ql = (j & 1) ? vi_srl16(q, 4) : q;
                    const vi16 qh = j == 0 ? vi_sll16(hb, 4) : j == 1 ? vi_sll16(hb, 2) : j == 2 ? hb : vi_srl16(hb, 2);
                    v[h] = vi_nib_hi2(ql, qh, m4, m30);
                }
                pq_dot_rows(R, NP, xb, L, 256 * s + 16 * u + 4 * j, v, S);
#ifdef QL_I16ACC
                if (j & 1) { /* int16 sums of two chunks at most */
                    pq_scale_add(R, NP, Ia, S, sc);
                    _Pragma("GCC unroll 2")
                    for (int h = 0; h < NP; h++)
                        _Pragma("GCC unroll 16")
                        for (int r = 0; r < R; r++) S[h][r] = vi_zero();
                }
#endif
            }
#ifdef QL_I16ACC
            _Pragma("GCC unroll 2")
            for (int h = 0; h < NP; h++)
                _Pragma("GCC unroll 16")
                for (int r = 0; r < R; r++) S[h][r] = pq_q6k_start(xb + r * L->stride, L, s, u);
            pq_scale_add32(R, NP, Ia, S, sc);
#else
            pq_scale_add(R, NP, Ia, S, sc);
#endif
        }
        _Pragma("GCC unroll 2")
        for (int h = 0; h < NP; h++) {
            const vf16 d = vf_h16(pp + h * ps + 3360 * s + 3328);
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                const vf16 dx = vf_set1(((const float *)(xb + r * L->stride + L->o_dx))[s]);
                float *o = out + 16 * (h * QP_R + r);
                vf_store(o, vf_fmadd(vf_cvt(vi_load(Ia + 16 * (h * QP_R + r))), vf_mul(d, dx), vf_load(o)));
            }
        }
    }
}

#define PQ_NP(FN, R_)                                                                                      \
    (NP == 2 ? FN(F_, R_, 2, xb, L, pp, ps, K, out) : FN(F_, R_, 1, xb, L, pp, ps, K, out))
#define PQ_ONE(FN, R_) FN(F_, R_, 1, xb, L, pp, ps, K, out)
/* R_ rows: one or two panels up to QP_R2 rows, one panel above; the cases above QP_R fold away */
#define PQ_R(FN, R_)                                                                                       \
    case R_:                                                                                               \
        if (R_ > QP_R) break;                                                                              \
        if (R_ > QP_R2) PQ_ONE(FN, R_);                                                                    \
        else PQ_NP(FN, R_);                                                                                \
        break;
#define PQ_DISPATCH(FN)                                                                                    \
    switch (R) {                                                                                           \
    PQ_R(FN, 16) PQ_R(FN, 15) PQ_R(FN, 14) PQ_R(FN, 13) PQ_R(FN, 12) PQ_R(FN, 11) PQ_R(FN, 10) PQ_R(FN, 9)    \
    PQ_R(FN, 8) PQ_R(FN, 7) PQ_R(FN, 6) PQ_R(FN, 5) PQ_R(FN, 4) PQ_R(FN, 3) PQ_R(FN, 2)                     \
    default: PQ_NP(FN, 1); break;                                                                          \
    }

#if QP_R41 == 4
#define PQ_DISPATCH41(FN)                                                                                  \
    switch (R) {                                                                                           \
    case 4: PQ_NP(FN, 4); break;                                                                           \
    case 3: PQ_NP(FN, 3); break;                                                                           \
    case 2: PQ_NP(FN, 2); break;                                                                           \
    default: PQ_NP(FN, 1); break;                                                                          \
    }
#else
#define PQ_DISPATCH41(FN)                                                                                  \
    if (R == 2) PQ_NP(FN, 2);                                                                              \
    else PQ_NP(FN, 1);
#endif

/* R rows x NP panels at pp, pp + ps -> out[(h * QP_R + r) * 16 + ch] */
static void pq_rows(int fmt, int R, int NP, const uint8_t *xb, const PXLay *L, const uint8_t *pp, int64_t ps,
                    int64_t K, float *out) {
#define PQ_CASE(F, DISPATCH, FN) \
    case F: {                    \
        const int F_ = F;        \
        DISPATCH(FN)             \
    } break;
    switch (fmt) {
    PQ_CASE(FMT_I8, PQ_DISPATCH, pq_q8x)
    PQ_CASE(FMT_Q8_0, PQ_DISPATCH, pq_q8x)
    PQ_CASE(FMT_Q4_0, PQ_DISPATCH41, pq_q4x)
    PQ_CASE(FMT_Q4_1, PQ_DISPATCH41, pq_q4x)
    PQ_CASE(FMT_Q4_K, PQ_DISPATCH, pq_q4k)
    PQ_CASE(FMT_Q6_K, PQ_DISPATCH, pq_q6k)
    default: break;
    }
#undef PQ_CASE
}
#undef PQ_DISPATCH
#undef PQ_DISPATCH41
#undef PQ_NP
#undef PQ_ONE
#undef PQ_R

#else /* scalar mirror */
#include "linear_panel_scalar.h"
#endif

/* How a call of M rows walks the panels: G panels per pass (a pair shares each activation load
   between two weight streams a panel apart; up to QP_SINGLE_ROWS rows a thread reads one panel at a
   time, one stream, which the memory keeps up with better) and rt rows per pass (at most cap, in
   passes as equal as can be: 16 rows as 8 + 8, not 12 + 4). Every choice gives the same bits. */
typedef struct { int G, rt; } PanelWalk;

static PanelWalk panel_walk(int fmt, int64_t M) {
    PanelWalk w;
    w.G = M <= QP_SINGLE_ROWS ? 1 : 2;
    const int cap = fmt == FMT_Q4_0 || fmt == FMT_Q4_1 ? QP_R41 : w.G == 1 ? QP_R : QP_R2;
    const int64_t passes = M > cap ? (M + cap - 1) / cap : 1;
    w.rt = (int)((M + passes - 1) / passes);
    return w;
}

/* pass p2 of a walk: panels [G p2, G p2 + G) of every row (quantized activations xb) -> out */
static void panel_pass(int fmt, PanelWalk w, int64_t p2, int64_t M, int64_t K, const uint8_t *xb, const PXLay *L,
                       const uint8_t *pw, const float *scale, const float *bias, float *out, int64_t N, int64_t ldo,
                       float *acc) {
    const int64_t np = panel_count(N), pstride = K / panel_act_block(fmt) * panel_block_bytes(fmt);
    const int64_t p = w.G * p2, n0 = p * PN;
    const int NP = p + 1 < np ? w.G : 1;
    for (int64_t m0 = 0; m0 < M; m0 += w.rt) {
        const int R = (int)(M - m0 < w.rt ? M - m0 : w.rt);
        pq_rows(fmt, R, NP, xb + m0 * L->stride, L, pw + p * pstride, pstride, K, acc);
        for (int r = 0; r < R; r++) /* panel by panel: 16 contiguous floats, no gather */
            for (int h = 0; h < NP; h++) {
                const float *a = acc + PN * (h * QP_R + r);
                const int64_t c0 = n0 + PN * h;
                const int nc = (int)(N - c0 < PN ? N - c0 : PN);
                float *o = out + (m0 + r) * ldo + c0;
                for (int c = 0; c < nc; c++) {
                    const float v = fmt == FMT_I8 ? a[c] * scale[c0 + c] : a[c];
                    o[c] = bias ? v + bias[c0 + c] : v;
                }
            }
    }
}

/* out[M, N] (row stride ldo) = x[M, K] @ W^T (* scale) (+ bias) for a panel-packed W (ss_panel_pack) */
static int linear_panel(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *pw, int fmt,
                        const float *scale, const float *bias, float *out, int64_t N, int64_t ldo, int nthreads) {
    PXLay L;
    px_layout(fmt, K, &L);
    uint8_t *xb = (uint8_t *)aligned_alloc(64, (size_t)(M * L.stride));
    if (!xb) return SS_ENOMEM;
    const int64_t np = panel_count(N);
    const int par = nthreads > 1 && (double)M * (double)N * (double)K > 200000.0 && np > 1;
    const PanelWalk w = panel_walk(fmt, M);
#pragma omp parallel num_threads(nthreads) if (par)
    {
        float acc[2 * QP_R * PN] SS_ALIGN;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) px_row(fmt, x + m * ldx, K, xb + m * L.stride, &L);
#pragma omp for schedule(static)
        for (int64_t p2 = 0; p2 < (np + w.G - 1) / w.G; p2++)
            panel_pass(fmt, w, p2, M, K, xb, &L, pw, scale, bias, out, N, ldo, acc);
    }
    free(xb);
    return SS_OK;
}

/* Several panel-packed weights of one format and shape [N, K] (a mixture's experts), each with its
   own rows: outs[g][Ms[g], N] = xs[g][Ms[g], K] @ W_g^T (* scales[g]), rows contiguous, in one
   parallel region over every weight's panels (one fork and join, the weights streamed back to back).
   Each output's arithmetic is linear_panel's, so every row's bits equal one call per weight. */
static int linear_panel_group(int ng, const float *const *xs, const int64_t *Ms, int64_t K, const uint8_t *const *ws,
                              int fmt, const float *const *scales, float *const *outs, int64_t N, int nthreads) {
    PXLay L;
    px_layout(fmt, K, &L);
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * ng + 2)); /* rows, then passes */
    if (!first) return SS_ENOMEM;
    int64_t *pass0 = first + ng + 1;
    const int64_t np = panel_count(N);
    first[0] = pass0[0] = 0;
    for (int g = 0; g < ng; g++) {
        first[g + 1] = first[g] + Ms[g];
        const PanelWalk w = panel_walk(fmt, Ms[g]);
        pass0[g + 1] = pass0[g] + (Ms[g] > 0 ? (np + w.G - 1) / w.G : 0);
    }
    const int64_t rows = first[ng], passes = pass0[ng];
    uint8_t *xb = (uint8_t *)aligned_alloc(64, (size_t)al64((rows > 0 ? rows : 1) * L.stride));
    if (!xb) {
        free(first);
        return SS_ENOMEM;
    }
    const int par = nthreads > 1 && (double)rows * (double)N * (double)K > 200000.0 && passes > 1;
#pragma omp parallel num_threads(nthreads) if (par)
    {
        float acc[2 * QP_R * PN] SS_ALIGN;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) {
            int g = 0;
            while (first[g + 1] <= m) g++;
            px_row(fmt, xs[g] + (m - first[g]) * K, K, xb + m * L.stride, &L);
        }
#pragma omp for schedule(static)
        for (int64_t q = 0; q < passes; q++) {
            int g = 0;
            while (pass0[g + 1] <= q) g++;
            panel_pass(fmt, panel_walk(fmt, Ms[g]), q - pass0[g], Ms[g], K, xb + first[g] * L.stride, &L, ws[g],
                       scales ? scales[g] : NULL, NULL, outs[g], N, N, acc);
        }
    }
    free(xb);
    free(first);
    return SS_OK;
}
