/*
 * Panel layout of the int8 and GGUF formats (I8, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) for the
 * integer-dot linear (linear_panel.h), and the activation record it reads.
 * Included by cpu_kernels.c after linear_q8.h (uses quant_block, h2f,
 * q4k_scale_min).
 *
 * A panel holds 16 output channels (the last one zero padded).  For each
 * weight block (32 values for Q4_1, 256 for Q4_K / Q6_K) the 16 channels'
 * bytes of that block are stored together, so one 64-byte vector holds the
 * same 4 input positions of all 16 channels (one int32 lane per channel):
 * the kernel multiplies it with 4 activation bytes broadcast to every lane
 * (dpbusd) and never sums across lanes.  Panels follow each other; inside a
 * panel the blocks are in K order.  The packing is a bijection on the bytes
 * (every raw block can be rebuilt from its panel: ss_panel_rows).
 *
 * I8 (blocks of 32 values, 512 bytes per block and panel): 8 chunks c of
 *   [16 ch][4 bytes] = the int8 values 32b + 4c .. +3 (the per-channel
 *   scale stays apart)
 * Q4_0 (288 bytes): qs as for Q4_1 (4 chunks), then d [16] f16
 * Q8_0 (544 bytes per block and panel):
 *   qs  8 chunks c of [16 ch][4 bytes] = raw qs[4c .. 4c+3] (int8 values 4c + i)
 *   d   [16] f16
 * Q4_1 (320 bytes per block and panel):
 *   qs  4 chunks c of [16 ch][4 bytes] = raw qs[4c .. 4c+3]: low nibble i is
 *       value 4c + i, high nibble value 16 + 4c + i
 *   d   [16] f16, m [16] f16
 * Q4_K (2368 bytes per super-block and panel):
 *   qs  32 chunks (g, c), g < 4, c < 8, of [16 ch][4 bytes] = raw
 *       qs[32g + 4c .. +3]: low nibble i is value 64g + 4c + i (sub-block
 *       2g), high nibble value 64g + 32 + 4c + i (sub-block 2g + 1)
 *   sc  [8 sub-blocks][16 ch] u8 (6-bit scales)
 *   mn  [2][16 ch][4] u8 (6-bit mins of sub-blocks 4h .. 4h+3)
 *   d   [16] f16, dmin [16] f16
 * Q6_K (3360 bytes per super-block and panel), values v = w + 32 in 0..63:
 *   ql  32 chunks t of [16 ch][4 bytes]: byte i holds the low 4 bits of
 *       value 8t + i (low nibble) and 8t + 4 + i (high nibble)
 *   qh  16 chunks u of [16 ch][4 bytes]: byte i bits 2j, 2j+1 are the top 2
 *       bits of value 16u + 4j + i
 *   sc  [16 sub-blocks of 16][16 ch] int8, d [16] f16
 */

#define PN 16 /* channels per panel */

static int panel_fmt(int fmt) { return fmt >= FMT_I8 && fmt <= FMT_Q6_K; }

/* values per activation block */
static int panel_act_block(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q6_K ? 256 : 32; }

/* bytes of one block-column of a panel (0: not a panel format) */
static int64_t panel_block_bytes(int fmt) {
    switch (fmt) {
    case FMT_I8: return 512;
    case FMT_Q8_0: return 544;
    case FMT_Q4_0: return 288;
    case FMT_Q4_1: return 320;
    case FMT_Q4_K: return 2368;
    case FMT_Q6_K: return 3360;
    default: return 0;
    }
}

static int64_t panel_count(int64_t N) { return (N + PN - 1) / PN; }

/* values and raw bytes of one block (I8: 32 values of its rows of int8) */
static int panel_geom(int fmt, int *be, int *bb) {
    if (fmt == FMT_I8) {
        *be = *bb = 32;
        return 0;
    }
    return fmt_block(fmt, be, bb);
}

static void q6k_values(const uint8_t *blk, uint8_t v[256]) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *pl = blk + 64 * h, *ph = blk + 128 + 32 * h;
        for (int l = 0; l < 32; l++) {
            v[128 * h + l] = (uint8_t)((pl[l] & 15) | ((ph[l] & 3) << 4));
            v[128 * h + l + 32] = (uint8_t)((pl[l + 32] & 15) | (((ph[l] >> 2) & 3) << 4));
            v[128 * h + l + 64] = (uint8_t)((pl[l] >> 4) | (((ph[l] >> 4) & 3) << 4));
            v[128 * h + l + 96] = (uint8_t)((pl[l + 32] >> 4) | (((ph[l] >> 6) & 3) << 4));
        }
    }
}

static void q6k_store_values(const uint8_t v[256], uint8_t *blk) {
    memset(blk, 0, 192);
    for (int h = 0; h < 2; h++) {
        uint8_t *pl = blk + 64 * h, *ph = blk + 128 + 32 * h;
        for (int l = 0; l < 32; l++) {
            const uint8_t a = v[128 * h + l], b = v[128 * h + l + 32], c = v[128 * h + l + 64],
                          e = v[128 * h + l + 96];
            pl[l] = (uint8_t)((a & 15) | ((c & 15) << 4));
            pl[l + 32] = (uint8_t)((b & 15) | ((e & 15) << 4));
            ph[l] = (uint8_t)((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
        }
    }
}

/* one raw block of channel ch -> its place in the panel block pb (dir 0),
   or back (dir 1) */
static void panel_block(int fmt, uint8_t *raw, uint8_t *pb, int ch, int dir) {
#define PMOVE(dst_in_panel, src_raw, n) \
    (dir ? memcpy((src_raw), (dst_in_panel), (n)) : memcpy((dst_in_panel), (src_raw), (n)))
    if (fmt == FMT_I8) {
        for (int c = 0; c < 8; c++) PMOVE(pb + 64 * c + 4 * ch, raw + 4 * c, 4);
    } else if (fmt == FMT_Q8_0) {
        for (int c = 0; c < 8; c++) PMOVE(pb + 64 * c + 4 * ch, raw + 2 + 4 * c, 4);
        PMOVE(pb + 512 + 2 * ch, raw, 2);
    } else if (fmt == FMT_Q4_0) {
        for (int c = 0; c < 4; c++) PMOVE(pb + 64 * c + 4 * ch, raw + 2 + 4 * c, 4);
        PMOVE(pb + 256 + 2 * ch, raw, 2);
    } else if (fmt == FMT_Q4_1) {
        for (int c = 0; c < 4; c++) PMOVE(pb + 64 * c + 4 * ch, raw + 4 + 4 * c, 4);
        PMOVE(pb + 256 + 2 * ch, raw, 2);
        PMOVE(pb + 288 + 2 * ch, raw + 2, 2);
    } else if (fmt == FMT_Q4_K) {
        for (int t = 0; t < 32; t++) PMOVE(pb + 64 * t + 4 * ch, raw + 16 + 4 * t, 4);
        PMOVE(pb + 2304 + 2 * ch, raw, 2);
        PMOVE(pb + 2336 + 2 * ch, raw + 2, 2);
        uint8_t *sc = pb + 2048, *mn = pb + 2176, *s12 = raw + 4;
        if (!dir) {
            for (int j = 0; j < 8; j++) {
                int s, m;
                q4k_scale_min(j, s12, &s, &m);
                sc[16 * j + ch] = (uint8_t)s;
                mn[64 * (j / 4) + 4 * ch + j % 4] = (uint8_t)m;
            }
        } else {
            for (int j = 0; j < 4; j++) {
                const int s0 = sc[16 * j + ch], s1 = sc[16 * (j + 4) + ch];
                const int m0 = mn[4 * ch + j], m1 = mn[64 + 4 * ch + j];
                s12[j] = (uint8_t)(s0 | ((s1 >> 4) << 6));
                s12[j + 4] = (uint8_t)(m0 | ((m1 >> 4) << 6));
                s12[j + 8] = (uint8_t)((s1 & 15) | ((m1 & 15) << 4));
            }
        }
    } else { /* Q6_K */
        PMOVE(pb + 3328 + 2 * ch, raw + 208, 2);
        for (int u = 0; u < 16; u++) PMOVE(pb + 3072 + 16 * u + ch, raw + 192 + u, 1);
        uint8_t v[256];
        if (!dir) {
            q6k_values(raw, v);
            for (int t = 0; t < 32; t++)
                for (int i = 0; i < 4; i++)
                    pb[64 * t + 4 * ch + i] = (uint8_t)((v[8 * t + i] & 15) | ((v[8 * t + 4 + i] & 15) << 4));
            for (int u = 0; u < 16; u++)
                for (int i = 0; i < 4; i++) {
                    uint8_t b = 0;
                    for (int j = 0; j < 4; j++) b |= (uint8_t)((v[16 * u + 4 * j + i] >> 4) << (2 * j));
                    pb[2048 + 64 * u + 4 * ch + i] = b;
                }
        } else {
            for (int t = 0; t < 32; t++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t b = pb[64 * t + 4 * ch + i];
                    v[8 * t + i] = b & 15;
                    v[8 * t + 4 + i] = b >> 4;
                }
            for (int u = 0; u < 16; u++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t b = pb[2048 + 64 * u + 4 * ch + i];
                    for (int j = 0; j < 4; j++) v[16 * u + 4 * j + i] |= (uint8_t)(((b >> (2 * j)) & 3) << 4);
                }
            q6k_store_values(v, raw);
        }
    }
#undef PMOVE
}

/* bytes of the packed form of an [N, K] weight (0: format has no panels) */
SS_EXPORT int64_t ss_panel_bytes(int fmt, int64_t N, int64_t K) {
    int be, bb;
    if (!panel_fmt(fmt) || panel_geom(fmt, &be, &bb) != 0 || N <= 0 || K <= 0 || K % be) return 0;
    return panel_count(N) * (K / be) * panel_block_bytes(fmt);
}

/* raw [N, row_bytes] GGUF rows -> panels (dst: ss_panel_bytes bytes) */
SS_EXPORT int ss_panel_pack(int fmt, const void *raw, int64_t N, int64_t K, int64_t row_bytes, void *dst,
                            int nthreads) {
    const int64_t total = ss_panel_bytes(fmt, N, K);
    int be, bb;
    if (total == 0 || panel_geom(fmt, &be, &bb) != 0 || row_bytes < K / be * bb) return SS_EINVAL;
    const int64_t nblk = K / be, pbb = panel_block_bytes(fmt), np = panel_count(N);
    nthreads = resolve_threads(nthreads);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && np > 1)
    for (int64_t p = 0; p < np; p++) {
        uint8_t *pp = (uint8_t *)dst + p * nblk * pbb;
        memset(pp, 0, (size_t)(nblk * pbb));
        uint8_t tmp[256];
        for (int ch = 0; ch < PN && p * PN + ch < N; ch++) {
            const uint8_t *row = (const uint8_t *)raw + (p * PN + ch) * row_bytes;
            for (int64_t b = 0; b < nblk; b++) {
                memcpy(tmp, row + b * bb, (size_t)bb);
                panel_block(fmt, tmp, pp + b * pbb, ch, 0);
            }
        }
    }
    return SS_OK;
}

/* channels idx[0 .. n) of a packed [N, K] weight -> raw GGUF rows dst [n, K / be * bb] */
SS_EXPORT int ss_panel_rows(int fmt, const void *packed, int64_t N, int64_t K, const int64_t *idx, int64_t n,
                            void *dst) {
    int be, bb;
    if (ss_panel_bytes(fmt, N, K) == 0 || panel_geom(fmt, &be, &bb) != 0 || n < 0) return SS_EINVAL;
    const int64_t nblk = K / be, pbb = panel_block_bytes(fmt), rb = nblk * bb;
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= N) return SS_EINVAL;
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = idx[i] / PN;
        const int ch = (int)(idx[i] % PN);
        uint8_t *pp = (uint8_t *)packed + p * nblk * pbb; /* read only (dir 1) */
        for (int64_t b = 0; b < nblk; b++) panel_block(fmt, (uint8_t *)dst + i * rb + b * bb, pp + b * pbb, ch, 1);
    }
    return SS_OK;
}

/* ------------------------------------------------------------------------ */
/* activation record of one row                                             */
/* ------------------------------------------------------------------------ */

/* q  int8 [K] natural order (offset 0)
   dx float [K / be] per activation block (32 values for Q8_0 / Q4_1, 256 for the K-quants)
   aux I8, Q8_0: int32 [K / 32] -128 * (sum of the block's q); Q4_0: -8 * the sum
       Q4_1: float [K / 32] dx * S (S: sum of the block's q)
       Q4_K: per super-block 16 int8: H[8], L[8] with S_j = 64 H_j + L_j,
             L_j in 0..63, S_j the sum of q over sub-block j of 32
       Q6_K: int32 [K / 16]: -32 * (sum of q over each 16)  */
typedef struct {
    int64_t stride, o_dx, o_aux;
} PXLay;

static void px_layout(int fmt, int64_t K, PXLay *L) {
    const int64_t be = panel_act_block(fmt);
    L->o_dx = al64(K);
    L->o_aux = L->o_dx + al64(4 * (K / be));
    const int64_t aux = fmt == FMT_Q4_K ? 16 * (K / 256) : fmt == FMT_Q6_K ? 4 * (K / 16) : 4 * (K / 32);
    L->stride = L->o_aux + al64(aux);
}

static void px_row(int fmt, const float *x, int64_t K, uint8_t *rec, const PXLay *L) {
    int8_t *q = (int8_t *)rec;
    float *dx = (float *)(rec + L->o_dx);
    const int be = panel_act_block(fmt);
    for (int64_t b = 0; b < K / be; b++) dx[b] = quant_block(x + be * b, be, q + be * b);
    if (fmt == FMT_I8 || fmt == FMT_Q8_0 || fmt == FMT_Q4_0) {
        int32_t *nc = (int32_t *)(rec + L->o_aux);
        for (int64_t b = 0; b < K / 32; b++) {
            int s = 0;
            for (int i = 0; i < 32; i++) s += q[32 * b + i];
            nc[b] = (fmt == FMT_Q4_0 ? -8 : -128) * s;
        }
    } else if (fmt == FMT_Q4_1) {
        float *dxs = (float *)(rec + L->o_aux);
        for (int64_t b = 0; b < K / 32; b++) {
            int s = 0;
            for (int i = 0; i < 32; i++) s += q[32 * b + i];
            dxs[b] = dx[b] * (float)s;
        }
    } else if (fmt == FMT_Q4_K) {
        int8_t *hl = (int8_t *)(rec + L->o_aux);
        for (int64_t j = 0; j < K / 32; j++) {
            int s = 0;
            for (int i = 0; i < 32; i++) s += q[32 * j + i];
            hl[16 * (j / 8) + j % 8] = (int8_t)(s >> 6); /* arithmetic shift: floor */
            hl[16 * (j / 8) + 8 + j % 8] = (int8_t)(s & 63);
        }
    } else {
        int32_t *nc = (int32_t *)(rec + L->o_aux);
        for (int64_t u = 0; u < K / 16; u++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += q[16 * u + i];
            nc[u] = -32 * s;
        }
    }
}
