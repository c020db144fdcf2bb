/* Experiment (kernel_experiments.sh, not kept): Q4_K over two panels of 16 channels at once, each
   activation broadcast serving both (32 channels), R rows in groups of RG_ with the sub-block sums
   I in registers; the same arithmetic as linear_panel.h's pq_q4k. ps: the second panel's offset,
   bs: bytes from one super-block to the next (IL in zen5_1206b/panel_calls.c: the two panels' super-blocks
   interleaved into one stream). */
/* one group of RG rows (rows r0 ..) over super-block s of two panels: I[h][r] = sum_j sc_j S_j */
SS_INLINE void q4k2_group(const int RG, const uint8_t *const *xr, int64_t s, const uint8_t *p0, const uint8_t *p1,
                          vi16 I0[], vi16 I1[], int pf) {
    const vi16 m4 = vi_set8(0x0F);
    _Pragma("GCC unroll 8")
    for (int j = 0; j < 8; j++) {
        if (pf && !(j & 1)) {
            pq_prefetch(p0 + 640 * (j / 2), j == 6 ? 448 : 640);
            pq_prefetch(p1 + 640 * (j / 2), j == 6 ? 448 : 640);
        }
        vi16 S0[8], S1[8];
        for (int r = 0; r < RG; r++) S0[r] = S1[r] = vi_zero();
        _Pragma("GCC unroll 8")
        for (int c = 0; c < 8; c++) {
            const vi16 a = vi_load(p0 + 64 * (8 * (j / 2) + c)), b = vi_load(p1 + 64 * (8 * (j / 2) + c));
            const vi16 w0 = (j & 1) ? vi_and(vi_srl16(a, 4), m4) : vi_and(a, m4);
            const vi16 w1 = (j & 1) ? vi_and(vi_srl16(b, 4), m4) : vi_and(b, m4);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < RG; r++) {
                const vi16 x = vi_bcast32(xr[r] + 256 * s + 32 * j + 4 * c);
                S0[r] = vi_dot4(S0[r], w0, x);
                S1[r] = vi_dot4(S1[r], w1, x);
            }
        }
        const vi16 sc0 = vi_u8(p0 + 2048 + 16 * j), sc1 = vi_u8(p1 + 2048 + 16 * j);
        for (int r = 0; r < RG; r++) {
            I0[r] = j ? vi_add32(I0[r], vi_mul32(S0[r], sc0)) : vi_mul32(S0[r], sc0);
            I1[r] = j ? vi_add32(I1[r], vi_mul32(S1[r], sc1)) : vi_mul32(S1[r], sc1);
        }
    }
}
SS_INLINE void q4k2_fin(const int RG, const uint8_t *const *xr, const PXLay *L, int64_t s, const uint8_t *pb,
                        const vi16 *I, float *out) {
    const vi16 mn0 = vi_load(pb + 2176), mn1 = vi_load(pb + 2240);
    const vf16 d = vf_h16(pb + 2304), dmin = vf_h16(pb + 2336);
    for (int r = 0; r < RG; r++) {
        const uint8_t *hl = xr[r] + L->o_aux + 16 * s;
        const vi16 hi = vi_dot4(vi_dot4(vi_zero(), mn0, vi_bcast32(hl)), mn1, vi_bcast32(hl + 4));
        const vi16 lo = vi_dot4(vi_dot4(vi_zero(), mn0, vi_bcast32(hl + 8)), mn1, vi_bcast32(hl + 12));
        const vi16 Mn = vi_add32(vi_sll32(hi, 6), lo);
        const vf16 dx = vf_set1(((const float *)(xr[r] + L->o_dx))[s]);
        float *o = out + 16 * r;
        const vf16 g = vf_fmadd(vf_cvt(I[r]), vf_mul(d, dx), vf_load(o));
        vf_store(o, vf_fnmadd(vf_cvt(Mn), vf_mul(dmin, dx), g));
    }
}
#ifndef RG_
#define RG_ 4
#endif
SS_INLINE void pq_q4k2(const int R, const uint8_t *xb, const PXLay *L, const uint8_t *pp, int64_t ps, int64_t bs,
                       int64_t K, float *out) {
    const uint8_t *xr[16];
    for (int r = 0; r < R; r++) xr[r] = xb + r * L->stride;
    for (int i = 0; i < 2 * QP_R; i++) vf_store(out + 16 * i, vf_zero());
    for (int64_t s = 0; s < K / 256; s++) {
        const uint8_t *p0 = pp + bs * s, *p1 = p0 + ps;
        for (int g = 0; g < R; g += RG_) {
            vi16 I0[8], I1[8];
            if (R - g >= RG_) {
                q4k2_group(RG_, xr + g, s, p0, p1, I0, I1, g == 0);
                q4k2_fin(RG_, xr + g, L, s, p0, I0, out + 16 * g);
                q4k2_fin(RG_, xr + g, L, s, p1, I1, out + 16 * (QP_R + g));
            } else {
                q4k2_group(R - g, xr + g, s, p0, p1, I0, I1, g == 0);
                q4k2_fin(R - g, xr + g, L, s, p0, I0, out + 16 * g);
                q4k2_fin(R - g, xr + g, L, s, p1, I1, out + 16 * (QP_R + g));
            }
        }
    }
}
