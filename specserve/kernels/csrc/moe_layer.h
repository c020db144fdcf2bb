/*
 * A mixture-of-experts MLP inside the hybrid layer stack (included by hybrid.h): the steps of
 * models/hybrid.py's SparseMoE.forward on the grouped path, in C.
 *
 *   router logits (float32 linear) -> ss_moe_route -> each used expert's rows gathered (experts
 *   ascending, rows ascending within one) -> all gate|up projections in one ss_linear_q8_group
 *   call (the shared expert in it when it is folded) -> act_mul -> all down projections in one
 *   call -> (the shared expert's own MLP when it is not folded) -> the shared gate (float32
 *   linear) -> ss_moe_combine.
 *
 * Each expert's output row depends on its input row alone, and the combine adds a row's experts in
 * ascending order, then the shared expert, so the result has the Python path's bits whatever order
 * the groups come in.
 */

/* one layer's experts: E routed (+ the shared one at index E when fold_shared), panel-packed,
   all gate|up weights of one format and shape, all down weights likewise */
typedef struct {
    SSLin router;      /* float32 [E, hidden] */
    SSLin shared_gate; /* float32 [1, hidden], or n == 0: no shared expert */
    SSLin shared_gu, shared_down; /* the shared expert apart (not folded), or n == 0 */
    const void *const *gate_up, *const *down;     /* [E (+1)] weight pointers */
    const float *const *gu_scales, *const *down_scales; /* per-row scales of int8 weights, or NULL */
    int32_t gu_fmt, down_fmt;
    int64_t E, k, width; /* experts, experts a token, an expert's intermediate width */
    int64_t shared_width; /* the shared expert's, when apart */
    int32_t renorm, fold_shared;
} SSMoE;

/* rows of the grouped calls: T k routed (+ T shared when folded) */
static int64_t moe_rows(const SSMoE *e, int64_t T) { return T * e->k + (e->fold_shared ? T : 0); }

typedef struct {
    float *logits, *w, *xs, *gu, *a, *y, *gate;
    int64_t *chosen, *idx, *count, *gm;
    const float **gx, **gs, **ds;
    const void **gw, **dw;
    float **go;
} MoEScratch;

/* s's buffers carved from base in order (base NULL: only counted); returns the floats they take
   (an int64 or a pointer counts as two) */
static int64_t moe_carve(const SSMoE *e, int64_t T, int64_t H, float *base, MoEScratch *s) {
    const int64_t k = e->k, I = e->width, G = 2 * (e->E + 1), rows = moe_rows(e, T), Is = e->shared_width;
    int64_t off = 0;
#define TAKE(field, n)                                       \
    do {                                                     \
        if (base) s->field = (void *)(base + off);           \
        off += al64(n);                                      \
    } while (0)
    TAKE(logits, T * e->E);
    TAKE(w, T * k);
    TAKE(chosen, 2 * T * k);
    TAKE(idx, 2 * T * (k + 1));
    TAKE(xs, T * k * H);
    TAKE(gu, rows * 2 * I + T * 2 * Is); /* the shared expert's rows when apart after the grouped ones */
    TAKE(a, rows * I + T * Is);
    TAKE(y, (rows + T) * H);
    TAKE(gate, T);
    TAKE(count, G);
    TAKE(gm, G);
    TAKE(gx, G);
    TAKE(gs, G);
    TAKE(ds, G);
    TAKE(gw, G);
    TAKE(dw, G);
    TAKE(go, G);
#undef TAKE
    return off;
}

/* groups of the experts used (ascending), each one's (row, slot) entries in row order (a counting
   sort), their rows gathered into s->xs; idx [T, k + 1]: entry (row, slot) -> its output row, and
   the shared expert's row last. Returns the number of groups. */
static int moe_plan(const SSMoE *e, const float *h, int64_t T, int64_t H, const MoEScratch *s) {
    const int64_t k = e->k, E = e->E;
    int ng = 0;
    for (int64_t x = 0; x < E; x++) s->count[x] = 0;
    for (int64_t j = 0; j < T * k; j++) s->count[s->chosen[j]]++;
    for (int64_t x = 0, at = 0; x < E; x++) {
        if (!s->count[x]) continue;
        s->gm[ng] = s->count[x], s->gw[ng] = e->gate_up[x], s->dw[ng] = e->down[x];
        s->gs[ng] = e->gu_scales ? e->gu_scales[x] : NULL, s->ds[ng] = e->down_scales ? e->down_scales[x] : NULL;
        s->gx[ng] = s->xs + at * H, s->count[x] = at, at += s->gm[ng], ng++;
    }
    for (int64_t j = 0; j < T * k; j++) { /* entry j goes to its expert's next row */
        const int64_t r = s->count[s->chosen[j]]++;
        s->idx[j / k * (k + 1) + j % k] = r;
        memcpy(s->xs + r * H, h + j / k * H, (size_t)H * sizeof(float));
    }
    for (int64_t t = 0; t < T; t++) s->idx[t * (k + 1) + k] = T * k + t; /* the shared expert's rows follow */
    if (e->fold_shared) { /* the shared expert on all rows, as the last group */
        s->gm[ng] = T, s->gx[ng] = h, s->gw[ng] = e->gate_up[E], s->dw[ng] = e->down[E];
        s->gs[ng] = e->gu_scales ? e->gu_scales[E] : NULL, s->ds[ng] = e->down_scales ? e->down_scales[E] : NULL;
        ng++;
    }
    return ng;
}

/* the MoE MLP on h [T, H] -> out [T, H]; scratch: moe_carve's floats */
static int moe_block(const SSMoE *e, int act, const float *h, int64_t T, int64_t H, float *out, float *scratch,
                     int nthreads) {
    const int64_t k = e->k, I = e->width, rows = moe_rows(e, T);
    MoEScratch s;
    moe_carve(e, T, H, scratch, &s);
    int rc;
    if ((rc = run_lin(&e->router, h, T, H, H, s.logits, e->E, nthreads))) return rc;
    if ((rc = ss_moe_route(s.logits, T, e->E, e->E, k, e->renorm, s.w, s.chosen))) return rc;
    const int ng = moe_plan(e, h, T, H, &s);
    for (int g = 0, at = 0; g < ng; at += (int)s.gm[g], g++) s.go[g] = s.gu + at * 2 * I;
    if ((rc = ss_linear_q8_group(ng, s.gx, s.gm, H, s.gw, e->gu_fmt, e->gu_scales ? s.gs : NULL, s.go, 2 * I,
                                 nthreads)))
        return rc;
    if ((rc = ss_act_mul(s.gu, s.gu + I, rows, I, 2 * I, 2 * I, act, s.a, I, nthreads))) return rc;
    for (int g = 0, at = 0; g < ng; at += (int)s.gm[g], g++) s.gx[g] = s.a + at * I, s.go[g] = s.y + at * H;
    if ((rc = ss_linear_q8_group(ng, s.gx, s.gm, I, s.dw, e->down_fmt, e->down_scales ? s.ds : NULL, s.go, H,
                                 nthreads)))
        return rc;
    if (e->shared_gu.n) { /* the shared expert apart: its own MLP, rows T k .. T k + T of y */
        const int64_t Is = e->shared_width;
        float *sgu = s.gu + rows * 2 * I, *sa = s.a + rows * I;
        if (e->shared_gu.n != 2 * Is) return SS_EINVAL;
        if ((rc = run_lin(&e->shared_gu, h, T, H, H, sgu, 2 * Is, nthreads))) return rc;
        if ((rc = ss_act_mul(sgu, sgu + Is, T, Is, 2 * Is, 2 * Is, act, sa, Is, nthreads))) return rc;
        if ((rc = run_lin(&e->shared_down, sa, T, Is, Is, s.y + rows * H, H, nthreads))) return rc;
    }
    const int shared = e->shared_gate.n != 0;
    if (shared && (rc = run_lin(&e->shared_gate, h, T, H, H, s.gate, 1, nthreads))) return rc;
    if (!shared) /* no shared expert: rows of k entries */
        for (int64_t t = 0; t < T; t++) memmove(s.idx + t * k, s.idx + t * (k + 1), (size_t)k * sizeof(int64_t));
    return ss_moe_combine(s.y, rows + (e->shared_gu.n ? T : 0), s.idx, s.w, T, k, H, shared ? s.gate : NULL, out,
                          nthreads);
}
