/*
 * Decoder-layer kernels (included at the end of cpu_kernels.c):
 *
 *   ss_rope        half-split rotary embedding (HF's rotate_half layout) from
 *                  precomputed fp32 cos / sin tables;
 *   ss_act_mul     silu(gate) * up, gelu_tanh(gate) * up;
 *   ss_decoder_layers
 *                  a stack of Llama / Qwen2 / Qwen3 decoder layers in one
 *                  call, made of the same kernels the Python path calls one
 *                  by one (ss_rms_norm, ss_linear / ss_linear_q8, ss_rope,
 *                  ss_act_mul, paged_attention_core), on the same buffers
 *                  shapes, so its results are bit-identical to that path.
 *
 * Rounding. rope and act_mul are elementwise: each output is a fixed
 * expression of its inputs with every product and sum rounded on its own
 * (no FMA contraction: the build passes -ffp-contract=off and SS_NOCONTRACT
 * repeats it per function), so the AVX2 loop and the scalar tail give the
 * same bits, and rope gives the bits of torch's
 * cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin). The activations use the
 * Cephes exp of the attention kernel (exp_avx2 / its scalar mirror
 * exp_scalar): silu(g) = g / (1 + exp(-g)),
 * gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g / (1 + exp(-2 u)),
 * u = sqrt(2 / pi) (g + 0.044715 g^3); within a few ulp of torch's.
 * Nothing reduces across rows: every row's result is independent of the
 * other rows of the call (batch invariance).
 */

#if defined(__clang__)
#pragma clang fp contract(off)
#define SS_NOCONTRACT
#elif defined(__GNUC__)
#define SS_NOCONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define SS_NOCONTRACT
#endif

/* extra error codes (keep in sync with ops._ERRORS) */
enum {
    SS_EROPE = -7, /* position beyond the rope table (or negative) */
    SS_ESLOT = -8, /* KV slot out of range of the cache */
    SS_EREDUCE = -9, /* the tensor-parallel reduce callback failed */
};

/* ------------------------------------------------------------------------ */
/* rope                                                                     */
/* ------------------------------------------------------------------------ */

/* o[0:h) = x1 * c - x2 * s; o[h:2h) = x2 * c + x1 * s with x1 = x[0:h), x2 = x[h:2h) */
SS_NOCONTRACT static void rope_row(const float *x, const float *c, const float *s, int64_t half, float *o) {
    int64_t i = 0;
#ifdef SS_AVX2
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
        const __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
        const __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
        _mm256_storeu_ps(o + i, o1);
        _mm256_storeu_ps(o + half + i, o2);
    }
#endif
    for (; i < half; i++) {
        const float x1 = x[i], x2 = x[half + i];
        const float a = x1 * c[i], b = x2 * s[i], p = x2 * c[i], q = x1 * s[i];
        o[i] = a - b;
        o[half + i] = p + q;
    }
}

/*
 * x: [T, H, D] with token stride ldx (floats; heads contiguous) -> out
 * [T, H, D] with token stride ldo, rotated at positions[t] by the tables
 * cos / sin [max_pos, D / 2].
 */
SS_EXPORT int ss_rope(const float *x, int64_t T, int64_t H, int64_t D, int64_t ldx, const int32_t *positions,
                      const float *cos_t, const float *sin_t, int64_t max_pos, float *out, int64_t ldo,
                      int nthreads) {
    if (T < 0 || H <= 0 || D <= 0 || D % 2 != 0 || ldx < H * D || ldo < H * D) return SS_EINVAL;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return SS_EROPE;
    nthreads = resolve_threads(nthreads);
    const int64_t half = D / 2;
    const int par = nthreads > 1 && T > 1 && (double)T * (double)H * (double)D > 65536.0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < H; h++) rope_row(x + t * ldx + h * D, c, s, half, out + t * ldo + h * D);
    }
    return SS_OK;
}

/* ------------------------------------------------------------------------ */
/* act_mul                                                                  */
/* ------------------------------------------------------------------------ */

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

#define GELU_K0 0.044715f
#define GELU_M2K (-1.5957691216057308f) /* -2 sqrt(2 / pi) */

/* o = act(g) * u over n values; act(g) = g / (1 + exp(a)) with a = -g
   (silu) or -2 sqrt(2/pi) (g + 0.044715 g^3) (gelu_tanh) */
SS_NOCONTRACT static void act_row(const float *g, const float *u, int64_t n, int act, float *o) {
    int64_t i = 0;
#ifdef SS_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), k0 = _mm256_set1_ps(GELU_K0), m2k = _mm256_set1_ps(GELU_M2K);
    const __m256 neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        __m256 a;
        if (act == ACT_SILU) {
            a = _mm256_xor_ps(gv, neg);
        } else {
            const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
            a = _mm256_mul_ps(m2k, _mm256_add_ps(gv, _mm256_mul_ps(k0, g3)));
        }
        const __m256 y = _mm256_div_ps(gv, _mm256_add_ps(one, exp_avx2(a)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) {
        const float gv = g[i];
        float a;
        if (act == ACT_SILU) {
            a = -gv;
        } else {
            const float g3 = (gv * gv) * gv;
            const float inner = gv + GELU_K0 * g3;
            a = GELU_M2K * inner;
        }
        const float den = 1.0f + exp_scalar(a);
        const float y = gv / den;
        o[i] = y * u[i];
    }
}

/* gate, up: [M, N] with row strides ldg / ldu -> out [M, N] with row stride ldo */
SS_EXPORT int ss_act_mul(const float *gate, const float *up, int64_t M, int64_t N, int64_t ldg, int64_t ldu,
                         int act, float *out, int64_t ldo, int nthreads) {
    if (M < 0 || N <= 0 || ldg < N || ldu < N || ldo < N) return SS_EINVAL;
    if (act != ACT_SILU && act != ACT_GELU_TANH) return SS_EINVAL;
    nthreads = resolve_threads(nthreads);
    /* a verification of 8 rows of a small model (8 x 1536 values) already pays for the threads */
    const int par = nthreads > 1 && M > 1 && (double)M * (double)N > 8192.0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t m = 0; m < M; m++) act_row(gate + m * ldg, up + m * ldu, N, act, out + m * ldo);
    return SS_OK;
}

/* ------------------------------------------------------------------------ */
/* a stack of decoder layers                                                */
/* ------------------------------------------------------------------------ */

/* one linear layer's weight (ops.py: Weight._c_args); n == 0: absent */
typedef struct {
    const void *w;       /* rows of row_bytes bytes in format fmt */
    const float *scale;  /* FMT_I8 per-row scale, else NULL */
    const float *bias;   /* [n] or NULL */
    int64_t n;           /* output features */
    int64_t row_bytes;
    int32_t fmt;
    int32_t int_dot;     /* 1: ss_linear_q8 (int8 activations), 0: ss_linear */
} SSLin;

/* slots of SSLayer.lin */
enum { LIN_Q = 0, LIN_K, LIN_V, LIN_O, LIN_GATE, LIN_UP, LIN_DOWN, LIN_COUNT };

/* one decoder layer: lin[LIN_Q] holds the fused q|k|v weight when lin[LIN_K].n == 0, and
   lin[LIN_GATE] the fused gate|up weight when lin[LIN_UP].n == 0 */
typedef struct {
    SSLin lin[LIN_COUNT];
    const float *attn_norm, *ffn_norm;  /* [hidden] */
    const float *q_norm, *k_norm;       /* [head_dim] (Qwen3) or NULL */
    int64_t window;                     /* sliding window (0: none) */
    const float *post_attn_norm, *post_ffn_norm; /* [hidden]: Gemma 3's sandwich norms, or NULL */
    const float *rope_cos, *rope_sin;   /* this layer's rope table (Gemma 3's local base), or NULL: SSModel's */
} SSLayer;

/* one layer's KV pools [num_blocks, block_size, Hkv, D] in format fmt (KV_*; int4: D / 2
   bytes), with scale pools for fp8 / int8 ([..., Hkv]) and int4 ([..., Hkv, D / group, 2]) */
typedef struct {
    void *k, *v;
    float *k_scales, *v_scales; /* NULL for fp32 / bf16 / f16 */
    int64_t num_blocks, block_size;
    int32_t fmt, group;         /* group: int4 values per (scale, min) */
    int32_t paging;             /* the rows this pool is written and read through: 0 r, 1 rw (KVCache.group) */
} SSKVPool;

/* model-wide sizes and tables */
typedef struct {
    int64_t hidden, n_heads, n_kv_heads, head_dim, inter;
    float eps, scale, softcap;
    int32_t act;                    /* ACT_* */
    const float *rope_cos, *rope_sin; /* [max_pos, head_dim / 2] */
    int64_t rope_max_pos;
    /* tensor parallel (NULL on one rank): sums a row-parallel linear's partial output [n] over
     * the ranks, in place, after o and after down; non-zero: the collective failed */
    int (*reduce)(float *x, int64_t n, void *ctx);
    void *reduce_ctx;
} SSModel;

/* the rows of one forward pass */
typedef struct {
    int64_t T;
    const int32_t *positions, *seq_ids; /* [T] */
    const int64_t *slots;               /* [T] flat KV slot */
    const int32_t *block_tables;        /* [S, max_blocks] */
    int64_t S, max_blocks;
} SSRows;

/* scratch activations of one layer, T rows each */
typedef struct {
    float *h;    /* [T, hidden] normed input */
    float *qkv;  /* [T, q + 2 kv] */
    float *qn;   /* [T, Hq | Hkv, D] q / k after qk-norm (Qwen3) */
    float *q;    /* [T, Hq, D] roped q */
    float *attn; /* [T, Hq, D] */
    float *o;    /* [T, hidden] o / down output */
    float *gu;   /* [T, 2 inter] */
    float *act;  /* [T, inter] */
    float *kr;   /* [Hkv, D] one roped K row before it is stored (quantized) in the cache */
} SSScratch;

/* out[T, n] (row stride ldo) = x[T, K] (row stride ldx) @ W^T: the call ops.linear makes */
static int run_lin(const SSLin *l, const float *x, int64_t T, int64_t K, int64_t ldx, float *out, int64_t ldo,
                   int nthreads) {
    if (l->int_dot)
        return ss_linear_q8(x, T, K, ldx, l->w, l->fmt, l->row_bytes, l->scale, l->bias, out, l->n, ldo, nthreads);
    return ss_linear(x, T, K, ldx, l->w, l->fmt, l->row_bytes, l->scale, l->bias, out, l->n, ldo, nthreads);
}

/* the linears lin[first .. first + parts) side by side into out[T, ldo] (or lin[first] alone when fused) */
static int run_lins(const SSLayer *L, int first, int parts, const float *x, int64_t T, int64_t K, float *out,
                    int64_t ldo, int nthreads) {
    if (L->lin[first + 1].n == 0) return run_lin(&L->lin[first], x, T, K, K, out, ldo, nthreads);
    int64_t col = 0;
    for (int j = first; j < first + parts; j++) {
        const int rc = run_lin(&L->lin[j], x, T, K, K, out + col, ldo, nthreads);
        if (rc) return rc;
        col += L->lin[j].n;
    }
    return SS_OK;
}

/* q -> s->q, k -> the K pool, v -> the V pool (qk-norm first when the layer has it) */
static int qkv_to_cache(const SSModel *m, const SSLayer *L, const SSKVPool *kv, const SSRows *r,
                        const SSScratch *s, int nthreads) {
    const int64_t T = r->T, D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t qs = Hq * D, kvs = Hkv * D, ld = qs + 2 * kvs;
    const int64_t nslots = kv->num_blocks * kv->block_size;
    for (int64_t t = 0; t < T; t++)
        if (r->slots[t] < 0 || r->slots[t] >= nslots) return SS_ESLOT;
    const float *q = s->qkv, *k = s->qkv + qs;
    int64_t ldq = ld, ldk = ld;
    int rc;
    if (L->q_norm) { /* per-head RMSNorm, as rms_norm(q.reshape(-1, D)) */
        float *kn = s->qn + T * qs;
        for (int64_t t = 0; t < T; t++) {
            if ((rc = ss_rms_norm(s->qkv + t * ld, Hq, D, D, L->q_norm, m->eps, 0, s->qn + t * qs, D, 1))) return rc;
            if ((rc = ss_rms_norm(s->qkv + t * ld + qs, Hkv, D, D, L->k_norm, m->eps, 0, kn + t * kvs, D, 1)))
                return rc;
        }
        q = s->qn, k = kn, ldq = qs, ldk = kvs;
    }
    const float *cos = L->rope_cos ? L->rope_cos : m->rope_cos, *sin = L->rope_cos ? L->rope_sin : m->rope_sin;
    if ((rc = ss_rope(q, T, Hq, D, ldq, r->positions, cos, sin, m->rope_max_pos, s->q, qs, nthreads))) return rc;
    for (int64_t t = 0; t < T; t++) { /* K roped, then K and V stored as KVCache.write stores them */
        const int64_t slot = r->slots[t];
        if ((rc = ss_rope(k + t * ldk, 1, Hkv, D, kvs, r->positions + t, cos, sin, m->rope_max_pos, s->kr, kvs,
                          1)))
            return rc;
        const float *v = s->qkv + t * ld + qs + kvs;
        for (int64_t h = 0; h < Hkv; h++) {
            kv_quant_row(kv->fmt, s->kr + h * D, (int)D, kv->group, kv->k, kv->k_scales, slot * Hkv + h);
            kv_quant_row(kv->fmt, v + h * D, (int)D, kv->group, kv->v, kv->v_scales, slot * Hkv + h);
        }
    }
    return SS_OK;
}

/* x[i] += y[i] over T rows of n */
static void add_rows(float *x, const float *y, int64_t n) {
    int64_t i = 0;
#ifdef SS_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) x[i] = x[i] + y[i];
}

/* x += (post ? rms_norm(y, post) : y) over T rows of the hidden size; h: scratch for the normed rows */
static int residual_add(const SSModel *m, float *x, const float *y, const float *post, float *h, int64_t T,
                        int nthreads) {
    const int64_t H = m->hidden;
    if (post) {
        const int rc = ss_rms_norm(y, T, H, H, post, m->eps, 0, h, H, nthreads);
        if (rc) return rc;
        y = h;
    }
    add_rows(x, y, T * H);
    return SS_OK;
}

/* Seconds spent in each stage of the decoder layers, summed over calls while profiling is on: a
   development tool (benchmarks/forward_breakdown.py --path fused), off by default. Process-global,
   like the prefetch hint; the stages run one after another on the calling thread (each parallel
   inside), so their wall times add up to the layers' time. */
enum { PF_NORM, PF_QKV, PF_ROPE_KV, PF_ATTN, PF_O, PF_RESIDUAL, PF_GATE_UP, PF_ACT, PF_DOWN, PF_STAGES };
static int pf_on = 0;
static double pf_sec[PF_STAGES];
/* out (or NULL) <- the sums so far (PF_STAGES doubles); then on >= 0 switches profiling on (1) or
   off (0) and zeroes the sums (on < 0: leaves both) */
SS_EXPORT int ss_decoder_profile(int on, double *out) {
    if (out) memcpy(out, pf_sec, sizeof pf_sec);
    if (on >= 0) pf_on = on != 0, memset(pf_sec, 0, sizeof pf_sec);
    return PF_STAGES;
}
static double pf_clock(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
/* rc = call, its time added to stage st while profiling; returns from the caller on an error */
#define PF_RUN(st, call)                                  \
    do {                                                  \
        const double t_ = pf_on ? pf_clock() : 0.0;      \
        rc = (call);                                      \
        if (pf_on) pf_sec[st] += pf_clock() - t_;         \
        if (rc) return rc;                                \
    } while (0)

/* one decoder layer on x [T, hidden] in place; the order of DecoderLayer.forward (models/transformer.py) */
static int decoder_layer(const SSModel *m, const SSLayer *L, const SSKVPool *kv, const SSRows *r, float *x,
                         const SSScratch *s, int nthreads) {
    const int64_t T = r->T, H = m->hidden, I = m->inter;
    const int64_t qs = m->n_heads * m->head_dim, ld = qs + 2 * m->n_kv_heads * m->head_dim;
    int rc;
    PF_RUN(PF_NORM, ss_rms_norm(x, T, H, H, L->attn_norm, m->eps, 0, s->h, H, nthreads));
    PF_RUN(PF_QKV, run_lins(L, LIN_Q, 3, s->h, T, H, s->qkv, ld, nthreads));
    PF_RUN(PF_ROPE_KV, qkv_to_cache(m, L, kv, r, s, nthreads));
    PF_RUN(PF_ATTN, paged_attention_core(kv->fmt, s->q, kv->k, kv->v, kv->k_scales, kv->v_scales, kv->group,
                                         kv->num_blocks, kv->block_size, m->n_kv_heads, r->block_tables, r->S,
                                         r->max_blocks, r->seq_ids, r->positions, T, m->n_heads, m->head_dim,
                                         m->scale, L->window, m->softcap, s->attn, nthreads));
    PF_RUN(PF_O, run_lin(&L->lin[LIN_O], s->attn, T, qs, qs, s->o, H, nthreads));
    if (m->reduce && m->reduce(s->o, T * H, m->reduce_ctx)) return SS_EREDUCE;
    PF_RUN(PF_RESIDUAL, residual_add(m, x, s->o, L->post_attn_norm, s->h, T, nthreads));
    PF_RUN(PF_NORM, ss_rms_norm(x, T, H, H, L->ffn_norm, m->eps, 0, s->h, H, nthreads));
    PF_RUN(PF_GATE_UP, run_lins(L, LIN_GATE, 2, s->h, T, H, s->gu, 2 * I, nthreads));
    PF_RUN(PF_ACT, ss_act_mul(s->gu, s->gu + I, T, I, 2 * I, 2 * I, m->act, s->act, I, nthreads));
    PF_RUN(PF_DOWN, run_lin(&L->lin[LIN_DOWN], s->act, T, I, I, s->o, H, nthreads));
    if (m->reduce && m->reduce(s->o, T * H, m->reduce_ctx)) return SS_EREDUCE;
    PF_RUN(PF_RESIDUAL, residual_add(m, x, s->o, L->post_ffn_norm, s->h, T, nthreads));
    return SS_OK;
}

/* a pool's format, scales and int4 group are usable for head_dim D */
static int pool_ok(const SSKVPool *p, int64_t D) {
    return p->block_size > 0 && kv_format_check(p->fmt, p->k_scales, p->v_scales, D, p->group) == SS_OK;
}

/*
 * Layers l0 .. l1 - 1 of a model on x [T, hidden] (in place): per layer
 * attn_norm, q|k|v, (qk-norm), rope, KV write, paged attention, o, (post-attention
 * norm), residual, ffn_norm, gate|up, act_mul, down, (post-FFN norm), residual. layers / pools: arrays over all
 * layers. rw (or NULL): the rows' slots and block tables of the pools whose paging is 1 (a
 * sliding-window pool of their own; same T, positions, seq ids as r). Scratch is allocated
 * per call (one block).
 */
SS_EXPORT int ss_decoder_layers(const SSModel *m, const SSLayer *layers, const SSKVPool *pools, int64_t l0,
                                int64_t l1, const SSRows *r, const SSRows *rw, float *x, int nthreads) {
    const int64_t T = r->T, H = m->hidden, I = m->inter, D = m->head_dim;
    if (T < 0 || H <= 0 || I <= 0 || D <= 0 || D % 2 || m->n_heads <= 0 || m->n_kv_heads <= 0) return SS_EINVAL;
    if (l0 < 0 || l1 < l0) return SS_EINVAL;
    if (T == 0 || l0 == l1) return SS_OK;
    const int64_t qs = m->n_heads * D, kvs = m->n_kv_heads * D;
    /* SSScratch order, floats per row (kr: one row in all) */
    const int64_t sizes[9] = {H, qs + 2 * kvs, qs + kvs, qs, qs, H, 2 * I, I, 0};
    int64_t total = al64(kvs);
    for (int j = 0; j < 8; j++) total += al64(T * sizes[j]);
    float *buf = (float *)aligned_alloc(64, sizeof(float) * (size_t)total);
    if (!buf) return SS_ENOMEM;
    float *p[9];
    for (int64_t j = 0, off = 0; j < 9; off += al64(T * sizes[j]), j++) p[j] = buf + off;
    const SSScratch s = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8]};
    int rc = SS_OK;
    for (int64_t i = l0; i < l1 && rc == SS_OK; i++) {
        const SSRows *rows = pools[i].paging == 0 ? r : pools[i].paging == 1 ? rw : NULL;
        rc = !pool_ok(pools + i, D) || !rows ? SS_EINVAL : decoder_layer(m, layers + i, pools + i, rows, x, &s, nthreads);
    }
    free(buf);
    return rc;
}
