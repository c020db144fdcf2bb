/*
 * A stack of hybrid decoder layers in one call (included at the end of
 * cpu_kernels.c, after deltanet.c): Qwen3.5 / Qwen3-Next's Gated DeltaNet
 * layers and gated full-attention layers, each followed by a dense gated MLP
 * (or by a mixture of experts that the caller runs: the call ends there).
 *
 *   ss_hybrid_layers  layers l0 .. l1 - 1 on x [T, hidden] in place
 *
 * It chains the kernels the Python path (models/hybrid.py: run_layers,
 * GatedDeltaNet.forward, GatedAttention.run, MLP.forward) calls one by one,
 * on the same rows and values: ss_rms_norm, ss_linear / ss_linear_q8,
 * ss_gated_delta per sequence, ss_act_mul, rope_row over the rotated part of
 * each head, kv_quant_row, paged_attention_core, ss_sigmoid_mul. Every one of
 * them computes a row (or an element) from that row alone, so calling one per
 * token where Python calls one per batch gives the same bits: the result is
 * bit-identical to the Python path (tests/test_hybrid_fused.py), and as batch
 * invariant as it is.
 *
 * Recurrent states: each DeltaNet layer's conv windows [slots, planes, K-1, C]
 * and delta-rule states [slots, planes, Hv, dk, dv] (and the prefix cache's
 * checkpoints [ckpts, ...]) are addressed from their base pointers by the
 * batch's slot / plane / checkpoint indices (ForwardBatch.state_*), as
 * GatedDeltaNet.state_io does.
 */

#include "moe_layer.h"

/* SSHybridLayer.lin slots: a DeltaNet layer's input projections side by side
   (q|k|v, z, b, a; a fused weight in the first slot and the rest absent) and its
   output projection; an attention layer's q (query | gate per head), k, v and o;
   the MLP's gate, up (absent when gate|up is fused) and down */
enum { HL_IN = 0, HL_Q = 0, HL_OUT = 4, HL_O = 4, HL_GATE = 5, HL_UP = 6, HL_DOWN = 7, HL_COUNT = 8 };

typedef struct {
    SSLin lin[HL_COUNT];
    const float *attn_norm, *ffn_norm; /* [hidden] */
    const float *q_norm, *k_norm;      /* [head_dim]: attention layers */
    /* DeltaNet layers: conv weights [K, C], A (= -exp(A_log)) and dt_bias [Hv], the gated norm [dv] */
    const float *conv_wt, *A, *dt_bias, *gnorm;
    float *conv, *ssm, *conv_ckpt, *ssm_ckpt; /* state pools (above) */
    int64_t slots, planes, ckpts;
    int32_t linear;      /* 1: Gated DeltaNet, 0: gated attention */
    int32_t mlp_outside; /* 1: the layer's MLP (a mixture of experts) runs outside: the call ends after its mixer */
    const SSMoE *moe;    /* the layer's mixture of experts (moe_layer.h), or NULL: the dense MLP of lin[] */
} SSHybridLayer;

typedef struct {
    SSModel m;       /* hidden, heads, head_dim, inter, eps, scale, softcap, act; rope table [max_pos, rot / 2] */
    int64_t rot;     /* rotated dims of each head (partial rotary), even, <= head_dim */
    int64_t Hk, Hv, dk, dv, conv_k;
    int32_t v_tiled; /* value head h reads key head h % Hk (llama.cpp's order), else h / (Hv / Hk) */
} SSHybridModel;

/* the batch's recurrent-state indices (ForwardBatch.state_*) and rope positions */
typedef struct {
    const int64_t *slots, *read, *ckpt_read; /* [S], by seq id; read / ckpt_read -1: none */
    const int64_t *write, *ckpt_write;       /* [T]; -1: none */
    const int32_t *rope_pos;                 /* [T]: rows of the rope table */
    /* the forward's own rope table [rope_rows, rot / 2] (rows with images: one M-RoPE row per token,
       rope_pos = 0 .. T-1), or NULL: the model's */
    const float *rope_cos, *rope_sin;
    int64_t rope_rows;
} SSStateRows;

typedef struct {
    float *h, *proj, *core, *normed, *gated, *q, *k, *kr, *o, *gu, *act;
    float **conv_out, **ssm_out; /* [T] each */
    float *moe;                  /* moe_carve's scratch for the largest mixture of experts */
} HScratch;

/* the present linears of lin[first .. first + parts) side by side into out [T, ldo] */
static int run_side(const SSHybridLayer *L, int first, int parts, const float *x, int64_t T, int64_t K, float *out,
                    int64_t ldo, int nthreads) {
    int64_t col = 0;
    for (int j = first; j < first + parts; j++) {
        if (L->lin[j].n == 0) continue;
        const int rc = run_lin(&L->lin[j], x, T, K, K, out + col, ldo, nthreads);
        if (rc) return rc;
        col += L->lin[j].n;
    }
    return col == ldo ? SS_OK : SS_EINVAL;
}

/* the first rot dims of each of H heads of D values rotated by row pos of the table, the rest copied */
static int rope_heads(const SSHybridModel *hm, const SSStateRows *st, const float *x, int64_t H, int32_t pos,
                      float *out) {
    const SSModel *m = &hm->m;
    const int64_t D = m->head_dim, half = hm->rot / 2;
    const float *cos_t = st->rope_cos ? st->rope_cos : m->rope_cos, *sin_t = st->rope_cos ? st->rope_sin : m->rope_sin;
    if (pos < 0 || pos >= (st->rope_cos ? st->rope_rows : m->rope_max_pos)) return SS_EROPE;
    const float *c = cos_t + pos * half, *s = sin_t + pos * half;
    for (int64_t h = 0; h < H; h++) {
        rope_row(x + h * D, c, s, half, out + h * D);
        memcpy(out + h * D + hm->rot, x + h * D + hm->rot, (size_t)(D - hm->rot) * sizeof(float));
    }
    return SS_OK;
}

/* gated attention (GatedAttention.run + attend) on the normed rows s->h; output into s->o */
static int attn_mixer(const SSHybridModel *hm, const SSHybridLayer *L, const SSKVPool *kv, const SSRows *r,
                      const SSStateRows *st, const HScratch *s, int nthreads) {
    const SSModel *m = &hm->m;
    const int64_t T = r->T, H = m->hidden, D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t qs = Hq * D, kvs = Hkv * D, P = 2 * qs + 2 * kvs;
    const int64_t nslots = kv->num_blocks * kv->block_size;
    int rc;
    if ((rc = run_side(L, HL_Q, 3, s->h, T, H, s->proj, P, nthreads))) return rc;
    for (int64_t t = 0; t < T; t++) {
        const float *row = s->proj + t * P;
        const int64_t slot = r->slots[t];
        if (slot < 0 || slot >= nslots) return SS_ESLOT;
        /* q: each head's first D of 2 D, normed then roped; k normed, roped, stored with v */
        if ((rc = ss_rms_norm(row, Hq, D, 2 * D, L->q_norm, m->eps, 0, s->normed, D, 1))) return rc;
        if ((rc = rope_heads(hm, st, s->normed, Hq, st->rope_pos[t], s->q + t * qs))) return rc;
        if ((rc = ss_rms_norm(row + 2 * qs, Hkv, D, D, L->k_norm, m->eps, 0, s->k, D, 1))) return rc;
        if ((rc = rope_heads(hm, st, s->k, Hkv, st->rope_pos[t], s->kr))) return rc;
        for (int64_t h = 0; h < Hkv; h++) {
            kv_quant_row(kv->fmt, s->kr + h * D, (int)D, kv->group, kv->k, kv->k_scales, slot * Hkv + h);
            kv_quant_row(kv->fmt, row + 2 * qs + kvs + h * D, (int)D, kv->group, kv->v, kv->v_scales, slot * Hkv + h);
        }
    }
    if ((rc = paged_attention_core(kv->fmt, s->q, kv->k, kv->v, kv->k_scales, kv->v_scales, kv->group,
                                   kv->num_blocks, kv->block_size, Hkv, r->block_tables, r->S, r->max_blocks,
                                   r->seq_ids, r->positions, T, Hq, D, m->scale, 0, m->softcap, s->core, nthreads)))
        return rc;
    for (int64_t t = 0; t < T; t++) /* attn * sigmoid(gate), the gate being each head's second D */
        if ((rc = ss_sigmoid_mul(s->proj + t * P + D, s->core + t * qs, Hq, D, 2 * D, D, s->gated + t * qs, 1)))
            return rc;
    return run_lin(&L->lin[HL_O], s->gated, T, qs, qs, s->o, H, nthreads);
}

/* a plane of layer L's conv (which 0) or ssm (1) states: slot's plane p, or checkpoint c when slot < 0;
   NULL when out of range */
static float *state_plane(const SSHybridModel *hm, const SSHybridLayer *L, int which, int64_t slot, int64_t p) {
    const int64_t C = 2 * hm->Hk * hm->dk + hm->Hv * hm->dv;
    const int64_t n = which ? hm->Hv * hm->dk * hm->dv : (hm->conv_k - 1) * C;
    if (slot < 0) return p >= 0 && p < L->ckpts ? (which ? L->ssm_ckpt : L->conv_ckpt) + p * n : NULL;
    if (slot >= L->slots || p < 0 || p >= L->planes) return NULL;
    return (which ? L->ssm : L->conv) + (slot * L->planes + p) * n;
}

/* one sequence's rows r0 .. r1 through the DeltaNet kernel (GatedDeltaNet.state_io's planes), into s->core */
static int dn_sequence(const SSHybridModel *hm, const SSHybridLayer *L, const SSStateRows *st, int32_t sid,
                       int64_t r0, int64_t r1, const HScratch *s, int nthreads) {
    const int64_t C = 2 * hm->Hk * hm->dk + hm->Hv * hm->dv, vd = hm->Hv * hm->dv, P = C + vd + 2 * hm->Hv;
    const int64_t slot = st->slots[sid], read = st->read[sid], ckr = st->ckpt_read[sid];
    const float *conv_in = NULL, *ssm_in = NULL;
    if (ckr >= 0 || read >= 0) {
        conv_in = ckr >= 0 ? state_plane(hm, L, 0, -1, ckr) : state_plane(hm, L, 0, slot, read);
        ssm_in = ckr >= 0 ? state_plane(hm, L, 1, -1, ckr) : state_plane(hm, L, 1, slot, read);
        if (!conv_in || !ssm_in) return SS_EINVAL;
    }
    for (int64_t t = r0; t < r1; t++) { /* the plane, else the checkpoint, receives the state after row t */
        const int64_t p = st->write[t], c = st->ckpt_write[t];
        float *pc = p >= 0 ? state_plane(hm, L, 0, slot, p) : NULL;
        float *ps = p >= 0 ? state_plane(hm, L, 1, slot, p) : NULL;
        float *cc = c >= 0 ? state_plane(hm, L, 0, -1, c) : NULL;
        float *cs = c >= 0 ? state_plane(hm, L, 1, -1, c) : NULL;
        if ((p >= 0 && (!pc || !ps)) || (c >= 0 && (!cc || !cs))) return SS_EINVAL;
        s->conv_out[t] = pc ? pc : cc;
        s->ssm_out[t] = ps ? ps : cs;
    }
    const float *row = s->proj + r0 * P;
    int rc = ss_gated_delta(r1 - r0, hm->Hk, hm->Hv, hm->dk, hm->dv, hm->conv_k, row, P, row + C + vd + hm->Hv,
                            row + C + vd, P, L->conv_wt, L->A, L->dt_bias, conv_in, ssm_in, s->conv_out + r0,
                            s->ssm_out + r0, s->core + r0 * vd, hm->v_tiled, nthreads);
    if (rc) return rc;
    for (int64_t t = r0; t < r1; t++) /* a row whose state goes to a plane and to a checkpoint */
        if (st->write[t] >= 0 && st->ckpt_write[t] >= 0) {
            memcpy(state_plane(hm, L, 0, -1, st->ckpt_write[t]), s->conv_out[t],
                   (size_t)((hm->conv_k - 1) * C) * sizeof(float));
            memcpy(state_plane(hm, L, 1, -1, st->ckpt_write[t]), s->ssm_out[t],
                   (size_t)(hm->Hv * hm->dk * hm->dv) * sizeof(float));
        }
    return SS_OK;
}

/* Gated DeltaNet (GatedDeltaNet.forward) on the normed rows s->h; output into s->o */
static int dn_mixer(const SSHybridModel *hm, const SSHybridLayer *L, const SSRows *r, const SSStateRows *st,
                    const HScratch *s, int nthreads) {
    const SSModel *m = &hm->m;
    const int64_t T = r->T, H = m->hidden, dv = hm->dv, vd = hm->Hv * dv;
    const int64_t C = 2 * hm->Hk * hm->dk + vd, P = C + vd + 2 * hm->Hv;
    int rc;
    if ((rc = run_side(L, HL_IN, 4, s->h, T, H, s->proj, P, nthreads))) return rc;
    for (int64_t r0 = 0, t = 1; t <= T; t++) /* a sequence's rows are contiguous */
        if (t == T || r->seq_ids[t] != r->seq_ids[r0]) {
            const int32_t sid = r->seq_ids[r0];
            if (sid < 0 || sid >= r->S) return SS_EINVAL;
            if ((rc = dn_sequence(hm, L, st, sid, r0, t, s, nthreads))) return rc;
            r0 = t;
        }
    /* norm(o) w * silu(z), head by head */
    if ((rc = ss_rms_norm(s->core, T * hm->Hv, dv, dv, L->gnorm, m->eps, 0, s->normed, dv, nthreads))) return rc;
    for (int64_t t = 0; t < T; t++)
        if ((rc = ss_act_mul(s->proj + t * P + C, s->normed + t * vd, hm->Hv, dv, dv, dv, ACT_SILU, s->gated + t * vd,
                             dv, nthreads)))
            return rc;
    return run_lin(&L->lin[HL_OUT], s->gated, T, vd, vd, s->o, H, nthreads);
}

/* layer L's MLP on x, residual included: the dense gated MLP (MLP.forward) or its mixture of experts */
static int mlp_block(const SSModel *m, const SSHybridLayer *L, int64_t T, float *x, const HScratch *s, int nthreads) {
    const int64_t H = m->hidden, I = m->inter;
    int rc;
    if ((rc = ss_rms_norm(x, T, H, H, L->ffn_norm, m->eps, 0, s->h, H, nthreads))) return rc;
    if (L->moe) {
        if ((rc = moe_block(L->moe, m->act, s->h, T, H, s->o, s->moe, nthreads))) return rc;
    } else {
        if ((rc = run_side(L, HL_GATE, 2, s->h, T, H, s->gu, 2 * I, nthreads))) return rc;
        if ((rc = ss_act_mul(s->gu, s->gu + I, T, I, 2 * I, 2 * I, m->act, s->act, I, nthreads))) return rc;
        if ((rc = run_lin(&L->lin[HL_DOWN], s->act, T, I, I, s->o, H, nthreads))) return rc;
    }
    /* tensor parallel: the row-parallel down projections' (or the experts') partial sums over the ranks */
    if (m->reduce && m->reduce(s->o, T * H, m->reduce_ctx)) return SS_EREDUCE;
    add_rows(x, s->o, T * H);
    return SS_OK;
}

static int hybrid_layer(const SSHybridModel *hm, const SSHybridLayer *L, const SSKVPool *kv, const SSRows *r,
                        const SSStateRows *st, float *x, const HScratch *s, int nthreads) {
    const SSModel *m = &hm->m;
    const int64_t T = r->T, H = m->hidden;
    int rc;
    if ((rc = ss_rms_norm(x, T, H, H, L->attn_norm, m->eps, 0, s->h, H, nthreads))) return rc;
    rc = L->linear ? dn_mixer(hm, L, r, st, s, nthreads) : attn_mixer(hm, L, kv, r, st, s, nthreads);
    if (rc) return rc;
    /* tensor parallel: the row-parallel output projection's partial sums over the ranks */
    if (m->reduce && m->reduce(s->o, T * H, m->reduce_ctx)) return SS_EREDUCE;
    add_rows(x, s->o, T * H);
    return L->mlp_outside ? SS_OK : mlp_block(m, L, T, x, s, nthreads);
}

/*
 * Layers l0 .. l1 - 1 of a hybrid model on x [T, hidden] in place. layers / pools: arrays over
 * all layers (a DeltaNet layer's pool is not read). A layer whose MLP runs outside ends the call
 * (l1 - 1) after its mixer's residual. Scratch is allocated per call (one block).
 */
SS_EXPORT int ss_hybrid_layers(const SSHybridModel *hm, const SSHybridLayer *layers, const SSKVPool *pools, int64_t l0,
                               int64_t l1, const SSRows *r, const SSStateRows *st, float *x, int nthreads) {
    const SSModel *m = &hm->m;
    const int64_t T = r->T, H = m->hidden, I = m->inter, D = m->head_dim;
    if (T < 0 || H <= 0 || I < 0 || D <= 0 || m->n_heads <= 0 || m->n_kv_heads <= 0 || l0 < 0 || l1 < l0)
        return SS_EINVAL;
    if (hm->rot <= 0 || hm->rot % 2 || hm->rot > D || hm->Hk <= 0 || hm->Hv <= 0 || hm->Hv % hm->Hk || hm->dk <= 0
        || hm->dv <= 0 || hm->conv_k < 1)
        return SS_EINVAL;
    if (T == 0 || l0 == l1) return SS_OK;
    const int64_t qs = m->n_heads * D, kvs = m->n_kv_heads * D, vd = hm->Hv * hm->dv;
    const int64_t C = 2 * hm->Hk * hm->dk + vd, Pd = C + vd + 2 * hm->Hv, Pa = 2 * qs + 2 * kvs;
    const int64_t wide = vd > qs ? vd : qs, proj = Pd > Pa ? Pd : Pa;
    int64_t moe = 0;
    for (int64_t i = l0; i < l1; i++)
        if (layers[i].moe) {
            const int64_t n = moe_carve(layers[i].moe, T, H, NULL, NULL);
            moe = n > moe ? n : moe;
        }
    /* HScratch's buffers in order, in floats (a pointer takes two) */
    const int64_t sizes[14] = {T * H, T * proj, T * wide, T * vd > qs ? T * vd : qs, T * wide, T * qs, kvs, kvs,
                               T * H, T * 2 * I, T * I, 2 * T, 2 * T, moe};
    int64_t total = 0;
    for (int j = 0; j < 14; j++) total += al64(sizes[j]);
    float *buf = (float *)aligned_alloc(64, sizeof(float) * (size_t)total);
    if (!buf) return SS_ENOMEM;
    float *p[14];
    for (int64_t j = 0, off = 0; j < 14; off += al64(sizes[j]), j++) p[j] = buf + off;
    const HScratch s = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], (float **)p[11],
                        (float **)p[12], p[13]};
    int rc = SS_OK;
    for (int64_t i = l0; i < l1 && rc == SS_OK; i++) {
        const SSHybridLayer *L = layers + i;
        if ((!L->linear && !pool_ok(pools + i, D)) || (L->mlp_outside && i != l1 - 1)) rc = SS_EINVAL;
        else rc = hybrid_layer(hm, L, pools + i, r, st, x, &s, nthreads);
    }
    free(buf);
    return rc;
}
