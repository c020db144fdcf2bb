/* Part of cpu_kernels.c (paged attention: work items, tiles, thread sharing, entry points): not compiled alone, cpu_kernels.c includes it
 * in order (one translation unit; build.py hashes every csrc file). */

#define ATT_TILE 64 /* keys per dequantized tile (a multiple of 8: the score groups stay the same) */
#ifndef ATT_F32_TILE_BYTES
/* an fp32 cache's keys per tile (read in place, not copied): the bytes of one pool's rows a tile
   keeps in L2 while every block of the item's query vectors (and both halves of a 128-dim row's V
   sums) go over it. One tile per item instead re-read qwen2.5-coder-1.5b's 1 MB of a kv head's K
   per block of 6 vectors, from beyond L2 at 2048 keys: its attention of 4 and 8 rows took 16-20%
   longer there, 28-40% at 8192 (results_final/zen5_1206c/att_tiles.txt); shorter items are one
   tile either way */
#define ATT_F32_TILE_BYTES (256 << 10)
#endif
#define ATT_COOP_KEYS 256 /* keys an item needs before threads share it (attn_coop) */

/* bytes of one stored (slot, kv head) row, and of its scales */
static int64_t kv_row_bytes(int fmt, int64_t D) {
    return fmt == KV_F32 ? 4 * D : fmt == KV_BF16 || fmt == KV_F16 ? 2 * D : fmt == KV_I4 ? D / 2 : D;
}
static int64_t kv_scale_bytes(int fmt, int64_t D, int64_t G) {
    return fmt == KV_I8 || fmt == KV_FP8_E4M3 ? 4 : fmt == KV_I4 ? 8 * (D / G) : 0;
}

/* prefetch bytes [b0, b0 + nb) of row rows[i] (when i < L) of a pool (rows of rb bytes), and its scales */
SS_INLINE void kv_prefetch(const void *base, const float *scales, const int64_t *rows, int64_t i, int64_t L,
                           int64_t rb, int64_t sb, int64_t b0, int64_t nb) {
    if (i >= L) return;
    prefetch_bytes((const char *)base + rows[i] * rb + b0, nb);
    if (sb) __builtin_prefetch((const char *)scales + rows[i] * sb, 0, 3);
}

/* keys [i0, i0 + n) of one pool as fp32 rows, of which dims [d0, d1) are read: an fp32 cache
   gives its own rows (*o = off + i0, float offsets into the pool); a quantized one dequantizes
   those dims into buf (row i at buf + i * D; off: rows; *o: offsets into buf), prefetching the
   rows ahead */
static const float *kv_tile(int fmt, const void *pool, const float *scales, int64_t G, const int64_t *off, int64_t i0,
                            int64_t n, int64_t L, int D, int d0, int d1, float *buf, const int64_t *toff,
                            const int64_t **o) {
    if (fmt == KV_F32) {
        *o = off + i0;
        return (const float *)pool;
    }
    const int64_t rb = kv_row_bytes(fmt, D), sb = kv_scale_bytes(fmt, D, G);
    const int64_t b0 = kv_row_bytes(fmt, d0), nb = kv_row_bytes(fmt, d1 - d0);
    for (int64_t i = 0; i < n; i++) {
        kv_prefetch(pool, scales, off, i0 + i + ATT_PF, L, rb, sb, b0, nb);
        kv_deq_row(fmt, pool, scales, off[i0 + i], D, (int)G, d0, d1, buf + i * D);
    }
    *o = toff;
    return buf;
}

/* the first key a query at position pos sees (window 0: every key from 0) */
SS_INLINE int64_t att_first_key(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* the keys of [lo, hi) in the tile [t0, t1) outside the common range [cs, ce) (none when
   ce <= cs): seg[0] .. seg[1] before it, seg[2] .. seg[3] after it (empty when end <= start) */
SS_INLINE void own_segments(int64_t lo, int64_t hi, int64_t cs, int64_t ce, int64_t t0, int64_t t1, int64_t seg[4]) {
    const int64_t a = lo > t0 ? lo : t0, b = hi < t1 ? hi : t1;
    if (ce <= cs) {
        seg[0] = a, seg[1] = b, seg[2] = seg[3] = 0;
        return;
    }
    seg[0] = a, seg[1] = b < cs ? b : cs;
    seg[2] = a > ce ? a : ce, seg[3] = b;
}

/*
 * One work item: nv query vectors (rows of one sequence x heads of one kv head); vector v has
 * query qs[v], keys lo[v] .. hi[v] - 1 of the item's key range (off[]: see kv_tile), scores in
 * scv[v], output outs[v]. Keys go by tiles of ATT_TILE (dequantized once for all vectors; an
 * fp32 cache: tiles of ATT_F32_TILE_BYTES, read in place). The keys every vector has (rounded
 * down to a multiple of 8) go through the multi-vector kernels, each vector's other keys (before and after them)
 * vector by vector, in key order. Per (vector, key) the arithmetic is that of the vector alone
 * (scores per key, exp_sub_sum over its own keys, V sums in key order), so a row's output does
 * not depend on the rows it shares an item with.
 *
 * An item runs in three phases: scores over a key range (item_scores), exp / sum per vector
 * (item_exps), V sums over a range of head dims (item_values). One thread runs all three over
 * the whole item (attn_item); when there are fewer items than threads, the threads share each
 * phase out (attn_coop) with the same arithmetic: scores and exps are per
 * key, the max is exact in any order, and each V sum still goes key by key for its dims.
 */
typedef struct {
    int fmt, nv, D;
    const void *kc, *vc;
    const float *ksc, *vsc;
    int64_t G;
    const int64_t *off; /* key offsets (fp32: floats into the pool; quantized: rows) */
    float scale, softcap;
    const float *qs[ATT_VMAX];
    float *outs[ATT_VMAX], *scv[ATT_VMAX], *accs[ATT_VMAX]; /* scv[v][i - lo[v]]: key i */
    int64_t lo[ATT_VMAX], hi[ATT_VMAX];
    float *mx, *sum; /* per vector */
    int64_t L, cs, ce; /* keys [0, L); the common keys [cs, ce) */
    int64_t toff[ATT_TILE]; /* quantized: offsets of a dequantized tile's rows (kv_tile) */
} AttItem;

/* the item of (row tile t .. t + nt - 1, heads h0 .. h0 + nh - 1 of kv head kvh); off: span
   int64s, sc: nv * maxlen floats, acc: nv * (D + 2) floats */
static void item_setup(AttItem *it, int fmt, const float *q, float *out, const void *kc, const void *vc,
                       const float *ksc, const float *vsc, int64_t G, int64_t BS, int64_t Hkv, int64_t Hq,
                       int64_t D, const int32_t *bt, const int32_t *positions, int64_t window, int64_t t,
                       int64_t nt, int64_t kvh, int64_t h0, int64_t nh, float scale, float softcap, int64_t *off,
                       float *sc, int64_t maxlen, float *acc) {
    int64_t first = INT64_MAX, last = 0; /* the item's keys: positions first .. last */
    for (int64_t r = 0; r < nt; r++) {
        const int64_t pos = positions[t + r], start = att_first_key(pos, window);
        first = start < first ? start : first;
        last = pos > last ? pos : last;
    }
    const int64_t mul = fmt == KV_F32 ? D : 1;
    for (int64_t p = first; p <= last;) { /* block by block: one division per block, not per key */
        const int64_t b = p / BS, end = (b + 1) * BS <= last ? (b + 1) * BS : last + 1;
        for (int64_t slot = (int64_t)bt[b] * BS + p % BS; p < end; p++, slot++) off[p - first] = (slot * Hkv + kvh) * mul;
    }
    *it = (AttItem){.fmt = fmt, .nv = (int)(nt * nh), .D = (int)D, .kc = kc, .vc = vc, .ksc = ksc, .vsc = vsc,
                    .G = G, .off = off, .scale = scale, .softcap = softcap};
    it->mx = acc + (int64_t)it->nv * D, it->sum = it->mx + it->nv;
    for (int i = 0; fmt != KV_F32 && i < ATT_TILE; i++) it->toff[i] = (int64_t)i * D;
    int64_t cs = 0, ce = INT64_MAX;
    for (int64_t r = 0, v = 0; r < nt; r++) {
        const int64_t pos = positions[t + r], start = att_first_key(pos, window);
        for (int64_t g = 0; g < nh; g++, v++) {
            it->qs[v] = q + ((t + r) * Hq + h0 + g) * D;
            it->outs[v] = out + ((t + r) * Hq + h0 + g) * D;
            it->lo[v] = start - first, it->hi[v] = pos - first + 1;
            it->scv[v] = sc + v * maxlen, it->accs[v] = acc + v * D;
            it->mx[v] = -INFINITY;
            it->L = it->hi[v] > it->L ? it->hi[v] : it->L;
            cs = it->lo[v] > cs ? it->lo[v] : cs;
            ce = it->hi[v] < ce ? it->hi[v] : ce;
        }
    }
    it->cs = cs, it->ce = ce > cs ? cs + (ce - cs) / 8 * 8 : cs;
}

/* length of the tile at key i0 of a range ending at k1: tiles start at keys congruent to cs mod
   8 (a first short tile before them), so the part of the common range in a tile is a multiple of
   8 keys, as the multi-vector kernels need; fp32 (read in place): ATT_F32_TILE_BYTES of its rows */
SS_INLINE int64_t item_tile(const AttItem *it, int64_t i0, int64_t k1) {
    const int64_t f32 = ATT_F32_TILE_BYTES / (4 * it->D) / 8 * 8;
    const int64_t whole = it->fmt != KV_F32 ? ATT_TILE : f32 > ATT_TILE ? f32 : ATT_TILE;
    const int64_t n = i0 == 0 && it->cs % 8 ? it->cs % 8 : whole;
    return k1 - i0 < n ? k1 - i0 : n;
}

/* scores of the keys [k0, k1) (k0: 0 or congruent to cs mod 8; k1: L or congruent to it), the
   max of each vector's among them into mx[v] */
static void item_scores(const AttItem *it, int64_t k0, int64_t k1, float *mx, float *kvbuf) {
    int64_t seg[4];
    const int pf = it->fmt == KV_F32; /* prefetch the pool's rows (a dequantized tile is in L1) */
    const int nv = it->nv;
    float *tsc[ATT_VMAX];
    const int64_t *o;
    for (int64_t i0 = k0, n; i0 < k1; i0 += n) {
        n = item_tile(it, i0, k1);
        const int64_t c0 = it->cs > i0 ? it->cs : i0, c1 = it->ce < i0 + n ? it->ce : i0 + n;
        const float *kb = kv_tile(it->fmt, it->kc, it->ksc, it->G, it->off, i0, n, k1, it->D, 0, it->D, kvbuf, it->toff, &o);
        if (c1 > c0) {
            for (int v = 0; v < nv; v++) tsc[v] = it->scv[v] + (c0 - it->lo[v]);
            attn_scores_multi(it->qs, nv, kb, o + (c0 - i0), c1 - c0, it->D, it->scale, it->softcap, tsc, mx, pf);
        }
        for (int v = 0; v < nv; v++) {
            own_segments(it->lo[v], it->hi[v], it->cs, it->ce, i0, i0 + n, seg);
            for (int j = 0; j < 4; j += 2) {
                if (seg[j + 1] <= seg[j]) continue;
                const float m = attn_scores(it->qs[v], kb, o + (seg[j] - i0), seg[j + 1] - seg[j], it->D, it->scale,
                                            it->softcap, it->scv[v] + (seg[j] - it->lo[v]), pf);
                mx[v] = m > mx[v] ? m : mx[v];
            }
        }
    }
}

/* vector v: scores -> exp(score - max), their sum */
static void item_exps(const AttItem *it, int v) {
    it->sum[v] = exp_sub_sum(it->scv[v], (int)(it->hi[v] - it->lo[v]), it->mx[v]);
}

/* outputs [d0, d1) of every vector: V sums over all keys in key order, divided by the sum */
static void item_values(const AttItem *it, int d0, int d1, float *kvbuf) {
    int64_t seg[4];
    const int pf = it->fmt == KV_F32, nv = it->nv, nd = d1 - d0;
    float *tsc[ATT_VMAX], *ac[ATT_VMAX];
    for (int v = 0; v < nv; v++) {
        ac[v] = it->accs[v] + d0;
        for (int d = 0; d < nd; d++) ac[v][d] = 0.0f;
    }
    const int64_t *o;
    for (int64_t i0 = 0, n; i0 < it->L; i0 += n) {
        n = item_tile(it, i0, it->L);
        const int64_t c0 = it->cs > i0 ? it->cs : i0, c1 = it->ce < i0 + n ? it->ce : i0 + n;
        const float *vb = kv_tile(it->fmt, it->vc, it->vsc, it->G, it->off, i0, n, it->L, it->D, d0, d1, kvbuf, it->toff, &o) + d0;
        for (int j = 0; j < 4; j += 2) {
            for (int v = 0; v < nv; v++) {
                own_segments(it->lo[v], it->hi[v], it->cs, it->ce, i0, i0 + n, seg);
                const float *pw = it->scv[v] + (seg[j] - it->lo[v]);
                if (seg[j + 1] > seg[j]) values_multi(1, &pw, vb, o + (seg[j] - i0), seg[j + 1] - seg[j], nd, ac + v, pf);
            }
            if (j == 0 && c1 > c0) { /* between the keys before and after: the common ones */
                for (int v = 0; v < nv; v++) tsc[v] = it->scv[v] + (c0 - it->lo[v]);
                attn_values_multi((const float *const *)tsc, nv, vb, o + (c0 - i0), c1 - c0, nd, ac, pf);
            }
        }
    }
    for (int v = 0; v < nv; v++)
        for (int d = 0; d < nd; d++) it->outs[v][d0 + d] = ac[v][d] / it->sum[v];
}

/* one thread, the whole item; kvbuf: ATT_TILE * D floats (quantized formats) */
static void attn_item(const AttItem *it, float *kvbuf) {
    item_scores(it, 0, it->L, it->mx, kvbuf);
    for (int v = 0; v < it->nv; v++) item_exps(it, v);
    item_values(it, 0, it->D, kvbuf);
}

/* key j of n near-equal chunks of [0, L): 0, L, or congruent to cs mod 8 (see item_scores) */
static int64_t coop_key(const AttItem *it, int64_t j, int64_t n) {
    if (j >= n) return it->L;
    const int64_t x = it->L * j / n, r = it->cs % 8;
    return x < r ? 0 : r + (x - r) / 8 * 8;
}

/* dim j of n near-equal parts of [0, D), at multiples of 16 (whole SIMD chunks) and, for int4,
   of its group (a thread dequantizes only its own dims) */
static int coop_dim(const AttItem *it, int j, int n) {
    const int a = it->fmt == KV_I4 && it->G > 16 ? (int)it->G : 16;
    return j >= n ? it->D : it->D * j / n / a * a;
}

/* all items shared by nthreads threads phase by phase (scores by key chunks, exps by vector, V
   sums by head-dim parts); pmx: items * nthreads * ATT_VMAX floats for the chunks' maxima */
static int attn_coop(AttItem *its, int64_t items, int nthreads, float *pmx) {
    const int64_t nc = nthreads, D = its[0].D;
    int64_t vstart[64 + 1]; /* items < nthreads <= 64 */
    vstart[0] = 0;
    for (int64_t i = 0; i < items; i++) vstart[i + 1] = vstart[i] + its[i].nv;
    int err = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *kvbuf = NULL;
        if (its[0].fmt != KV_F32 && !(kvbuf = (float *)malloc(sizeof(float) * (size_t)(ATT_TILE * D + 16)))) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t task = 0; task < items * nc; task++) {
            const AttItem *it = its + task / nc;
            float *m = pmx + task * ATT_VMAX;
            for (int v = 0; v < it->nv; v++) m[v] = -INFINITY;
            if (!err) item_scores(it, coop_key(it, task % nc, nc), coop_key(it, task % nc + 1, nc), m, kvbuf);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < vstart[items]; task++) {
            int64_t i = 0;
            while (vstart[i + 1] <= task) i++;
            const int v = (int)(task - vstart[i]);
            float m = -INFINITY;
            for (int64_t c = 0; c < nc; c++) { /* the chunks in key order: the sequential max */
                const float x = pmx[(i * nc + c) * ATT_VMAX + v];
                m = x > m ? x : m;
            }
            its[i].mx[v] = m;
            item_exps(its + i, v);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < items * nc; task++) {
            const AttItem *it = its + task / nc;
            if (!err) item_values(it, coop_dim(it, (int)(task % nc), (int)nc), coop_dim(it, (int)(task % nc) + 1, (int)nc), kvbuf);
        }
        free(kvbuf);
    }
    return err;
}

/*
 * q:            [T, Hq, D]
 * k/v cache:    [NB, BS, Hkv, D]
 * block_tables: [S, max_blocks]
 * seq_ids, positions: [T]
 * out:          [T, Hq, D]
 *
 * Work item = (up to ATT_QT rows of one sequence (at consecutive positions
 * with a sliding window), kv head, the group of query heads sharing it): the key
 * offsets are resolved once per item, and each K / V row is read (or
 * dequantized) once for all its query vectors (attn_item). Per (query, head)
 * the arithmetic is fixed: scores per key, max, exp/sum (exp_sub_sum), V
 * accumulation in key order, division by the sum; so a row's output does not
 * depend on the other rows of the call or the thread count.
 */
static int paged_attention_core(int fmt, const float *q, const void *kc, const void *vc, const float *ksc,
                                const float *vsc, int64_t G, int64_t num_blocks, int64_t BS, int64_t Hkv,
                                const int32_t *block_tables, int64_t S, int64_t max_blocks,
                                const int32_t *seq_ids, const int32_t *positions, int64_t T, int64_t Hq,
                                int64_t D, float scale, int64_t window, float softcap, float *out,
                                int nthreads) {
    if (T < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D > ATT_DMAX || BS <= 0 || Hq % Hkv != 0)
        return SS_EINVAL;
    const int frc = kv_format_check(fmt, ksc, vsc, D, G);
    if (frc) return frc;
    if (T == 0) return SS_OK;
    /* validate indices before touching memory */
    int64_t maxlen = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t s = seq_ids[t], pos = positions[t];
        if (s < 0 || s >= S) return SS_ESEQ;
        if (pos < 0 || pos / BS >= max_blocks) return SS_EPOS;
        int64_t start = att_first_key(pos, window);
        for (int64_t b = start / BS; b <= pos / BS; b++) {
            int32_t blk = block_tables[s * max_blocks + b];
            if (blk < 0 || blk >= num_blocks) return SS_EBLOCK;
        }
        if (pos - start + 1 > maxlen) maxlen = pos - start + 1;
    }
    nthreads = resolve_threads(nthreads);
    const int64_t group = Hq / Hkv;
    /* rows per work item: up to ATT_QT rows of one sequence (each K / V row is read, or
       dequantized, once for all of them and their heads); with a window, only rows at
       consecutive positions, so that the item's keys (the union of theirs, all validated
       above) have no gap. span: the most keys an item covers. */
    const int64_t qt = group <= ATT_VMAX ? (ATT_VMAX / group < ATT_QT ? ATT_VMAX / group : ATT_QT) : 1;
    int64_t *tile0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T + 1)), ntiles = 0, span = 0;
    if (!tile0) return SS_ENOMEM;
    for (int64_t t = 0; t < T; ntiles++) {
        int64_t n = 1, lo = positions[t], hi = positions[t];
        while (n < qt && t + n < T && seq_ids[t + n] == seq_ids[t] &&
               (window == 0 || positions[t + n] == positions[t + n - 1] + 1)) {
            lo = positions[t + n] < lo ? positions[t + n] : lo;
            hi = positions[t + n] > hi ? positions[t + n] : hi;
            n++;
        }
        lo = att_first_key(lo, window);
        span = hi - lo + 1 > span ? hi - lo + 1 : span;
        tile0[ntiles] = t;
        t += n;
    }
    tile0[ntiles] = T;
    /* heads per work item: the whole group of a kv head (its vectors share each K / V row), in
       near-equal parts of at most ATT_VMAX. Which heads share an item does not change any head's
       arithmetic. */
    const int64_t parts = (group + ATT_VMAX - 1) / ATT_VMAX;
    const int64_t items = ntiles * Hkv * parts, nvmax = qt * ((group + parts - 1) / parts);
    const double work = (double)T * Hq * (double)maxlen * (double)D;
    /* fewer items than threads (decode: one row, fewer kv heads than threads) over enough keys:
       the threads share each item's phases instead of some of them idling. (3 items on 2
       threads measured no faster shared: a single thread nearly saturates memory there.) */
    const int coop = items < nthreads && nthreads <= 64 && maxlen >= ATT_COOP_KEYS;
    const int par = nthreads > 1 && items > 1 && work > 30000.0;
    int err = 0;
#define ITEM_SETUP(IT, I, OFF, SC, ACC)                                                                    \
    do {                                                                                                   \
        const int64_t tl = (I) / (Hkv * parts), t = tile0[tl], nt = tile0[tl + 1] - t;                     \
        const int64_t kvh = (I) % (Hkv * parts) / parts, part = (I) % parts;                               \
        const int64_t h0 = kvh * group + part * group / parts, nh = kvh * group + (part + 1) * group / parts - h0; \
        item_setup(IT, fmt, q, out, kc, vc, ksc, vsc, G, BS, Hkv, Hq, D, block_tables + seq_ids[t] * max_blocks, \
                   positions, window, t, nt, kvh, h0, nh, scale, softcap, OFF, SC, maxlen, ACC);           \
    } while (0)
    if (coop) {
        AttItem *its = (AttItem *)malloc(sizeof(AttItem) * (size_t)items);
        int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(items * (span + 16)));
        float *sc = (float *)malloc(sizeof(float) * (size_t)(items * (nvmax * maxlen + 16)));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(items * (nvmax * (D + 2) + 16)));
        float *pmx = (float *)malloc(sizeof(float) * (size_t)(items * nthreads * ATT_VMAX));
        err = !its || !off || !sc || !acc || !pmx;
        for (int64_t i = 0; !err && i < items; i++)
            ITEM_SETUP(its + i, i, off + i * (span + 16), sc + i * (nvmax * maxlen + 16), acc + i * (nvmax * (D + 2) + 16));
        if (!err) err = attn_coop(its, items, nthreads, pmx);
        free(its), free(off), free(sc), free(acc), free(pmx), free(tile0);
        return err ? SS_ENOMEM : SS_OK;
    }

#pragma omp parallel num_threads(nthreads) if (par)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(nvmax * maxlen + 16));
        int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(span + 16));
        /* quantized formats: ATT_TILE K or V rows of one kv head dequantized to fp32 at a time
           (small enough to stay in L1 / L2); the V sums of the item's vectors */
        float *kvbuf = NULL, *acc = (float *)malloc(sizeof(float) * (size_t)(nvmax * (D + 2) + 16));
        if (fmt != KV_F32) kvbuf = (float *)malloc(sizeof(float) * (size_t)(ATT_TILE * D + 16));
        if (!acc || (fmt != KV_F32 && !kvbuf)) {
            free(sc);
            sc = NULL;
        }
        if (!sc || !off) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!sc || !off) continue;
            AttItem it;
            ITEM_SETUP(&it, i, off, sc, acc);
            attn_item(&it, kvbuf);
        }
        free(sc);
        free(off);
        free(kvbuf);
        free(acc);
    }
#undef ITEM_SETUP
    free(tile0);
    return err ? SS_ENOMEM : SS_OK;
}

SS_EXPORT int ss_paged_attention(const float *q, const float *kc, const float *vc, int64_t num_blocks,
                                 int64_t BS, int64_t Hkv, const int32_t *block_tables, int64_t S,
                                 int64_t max_blocks, const int32_t *seq_ids, const int32_t *positions,
                                 int64_t T, int64_t Hq, int64_t D, float scale, int64_t window,
                                 float softcap, float *out, int nthreads) {
    return paged_attention_core(KV_F32, q, kc, vc, NULL, NULL, 0, num_blocks, BS, Hkv, block_tables, S,
                                max_blocks, seq_ids, positions, T, Hq, D, scale, window, softcap, out, nthreads);
}

/* paged attention over a KV cache in format fmt (KV_*); ksc / vsc: the scale
   pools (fp8 / int8: [NB, BS, Hkv]; int4: [NB, BS, Hkv, D / G, 2]) */
SS_EXPORT int ss_paged_attention_kv(int fmt, const float *q, const void *kc, const void *vc, const float *ksc,
                                    const float *vsc, int64_t G, int64_t num_blocks, int64_t BS, int64_t Hkv,
                                    const int32_t *block_tables, int64_t S, int64_t max_blocks,
                                    const int32_t *seq_ids, const int32_t *positions, int64_t T, int64_t Hq,
                                    int64_t D, float scale, int64_t window, float softcap, float *out,
                                    int nthreads) {
    return paged_attention_core(fmt, q, kc, vc, ksc, vsc, G, num_blocks, BS, Hkv, block_tables, S, max_blocks,
                                seq_ids, positions, T, Hq, D, scale, window, softcap, out, nthreads);
}

