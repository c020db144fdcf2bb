/*
 * The scalar mirror of linear_panel.h's vector kernels (builds without AVX2): one row of one
 * panel at a time, channel by channel, with the same integer sums and the same float updates in
 * the same order, so every build gives the same bits. Included by linear_panel.h in place of
 * the vector kernels.
 */

#define QP_R 1
#define QP_R2 1
#define QP_R41 1

static void pq_panel(int fmt, const uint8_t *xb, const PXLay *L, const uint8_t *pp, int64_t K, float *out);

static void pq_rows(int fmt, int R, int NP, const uint8_t *xb, const PXLay *L, const uint8_t *pp, int64_t ps,
                    int64_t K, float *out) {
    (void)R;
    for (int h = 0; h < NP; h++) pq_panel(fmt, xb, L, pp + h * ps, K, out + 16 * h);
}

/* one row of one panel: out[ch] */
static void pq_panel(int fmt, const uint8_t *xb, const PXLay *L, const uint8_t *pp, int64_t K, float *out) {
    const int8_t *q = (const int8_t *)xb;
    const float *dx = (const float *)(xb + L->o_dx);
    for (int ch = 0; ch < PN; ch++) {
        float f = 0.0f;
        if (fmt == FMT_I8 || fmt == FMT_Q8_0) {
            const int64_t bb = panel_block_bytes(fmt);
            for (int64_t b = 0; b < K / 32; b++) {
                const uint8_t *pb = pp + bb * b;
                int S = 0;
                for (int c = 0; c < 8; c++)
                    for (int i = 0; i < 4; i++) S += (int8_t)pb[64 * c + 4 * ch + i] * q[32 * b + 4 * c + i];
                f = fmaf((float)S, fmt == FMT_I8 ? dx[b] : h2f(pb + 512 + 2 * ch) * dx[b], f);
            }
        } else if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
            const int64_t bb = panel_block_bytes(fmt), off = fmt == FMT_Q4_0 ? 8 : 0;
            const float *dxs = (const float *)(xb + L->o_aux);
            for (int64_t b = 0; b < K / 32; b++) {
                const uint8_t *pb = pp + bb * b;
                int S = 0;
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t w = pb[64 * c + 4 * ch + i];
                        S += ((w & 15) - off) * q[32 * b + 4 * c + i] + ((w >> 4) - off) * q[32 * b + 16 + 4 * c + i];
                    }
                f = fmaf((float)S, h2f(pb + 256 + 2 * ch) * dx[b], f);
                if (fmt == FMT_Q4_1) f = fmaf(h2f(pb + 288 + 2 * ch), dxs[b], f);
            }
        } else if (fmt == FMT_Q4_K) {
            for (int64_t s = 0; s < K / 256; s++) {
                const uint8_t *pb = pp + 2368 * s;
                const int8_t *xq = q + 256 * s, *hl = (const int8_t *)(xb + L->o_aux) + 16 * s;
                int I = 0, Mn = 0;
                for (int j = 0; j < 8; j++) {
                    const int g = j / 2, sh = 4 * (j % 2);
                    int S = 0;
                    for (int c = 0; c < 8; c++)
                        for (int i = 0; i < 4; i++)
                            S += ((pb[64 * (8 * g + c) + 4 * ch + i] >> sh) & 15) * xq[64 * g + 32 * (j % 2) + 4 * c + i];
                    I += S * pb[2048 + 16 * j + ch];
                    Mn += pb[2176 + 64 * (j / 4) + 4 * ch + j % 4] * (64 * hl[j] + hl[8 + j]);
                }
                const float d = h2f(pb + 2304 + 2 * ch), dmin = h2f(pb + 2336 + 2 * ch);
                f = fmaf((float)I, d * dx[s], f);
                f = fmaf(-(dmin * dx[s]), (float)Mn, f);
            }
        } else {
            const int32_t *nc = (const int32_t *)(xb + L->o_aux);
            for (int64_t s = 0; s < K / 256; s++) {
                const uint8_t *pb = pp + 3360 * s;
                int I = 0;
                for (int u = 0; u < 16; u++) {
                    int S = nc[16 * s + u];
                    for (int j = 0; j < 4; j++)
                        for (int i = 0; i < 4; i++) {
                            const int e = 16 * u + 4 * j + i, t = e / 8, nib = (e % 8) / 4;
                            const int lo = (pb[64 * t + 4 * ch + i] >> (4 * nib)) & 15;
                            const int hi = (pb[2048 + 64 * u + 4 * ch + i] >> (2 * j)) & 3;
                            S += (lo | (hi << 4)) * q[256 * s + e];
                        }
                    I += S * (int8_t)pb[3072 + 16 * u + ch];
                }
                f = fmaf((float)I, h2f(pb + 3328 + 2 * ch) * dx[s], f);
            }
        }
        out[ch] = f;
    }
}
