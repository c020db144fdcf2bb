/* Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next linear-attention layers).
 *
 *   ss_gated_delta   one sequence's rows: the causal depthwise conv over its
 *                    q|k|v channels (with the conv window before the rows),
 *                    SiLU, L2-normalised q / k, beta = sigmoid(b),
 *                    decay = exp(A * softplus(a + dt_bias)), and the gated
 *                    delta rule over a float32 state S [Hv, dk, dv]:
 *
 *                      S     = decay * S
 *                      delta = beta * (v - S^T k)
 *                      S     = S + k delta^T
 *                      o     = S^T q
 *
 *                    optionally writing the conv window and the state after
 *                    any row (the snapshots speculative rollback picks from).
 *
 * Arithmetic. Every value is a fixed sequence of float operations on its own
 * inputs: the conv sums its K taps in tap order, the norms sum dk squares in
 * index order, S^T k and S^T q sum over dk in index order (the vector lanes
 * run over dv, so vectorising reorders nothing), and nothing depends on the
 * number of rows of the call or on the thread count (threads split the
 * channels of the conv and the value heads of the recurrence). So a row's
 * outputs are the same whether the sequence's tokens come one per call
 * (decode), several per call (verification) or as a prompt chunked anywhere:
 * the recurrence is inherently token by token, and prefill runs the same
 * per-token steps as decode.
 */

static inline float dn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

static inline float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold */

/* y = y / (1 + exp(-y)) over n values with the kernels' Cephes exp (exp_avx2 and its scalar mirror
   exp_scalar, as act_mul's silu): the same bits in every build, a vector pass instead of libm's expf
   one value at a time */
#ifndef DN_SILU_LIBM
#define DN_SILU_LIBM 0 /* 1: libm's expf one value at a time (before 2026-12-08; results_final/zen4_1208) */
#endif
static void SS_NOCONTRACT dn_silu(float *y, int64_t n) {
    int64_t i = 0;
    if (DN_SILU_LIBM) {
        for (; i < n; i++) y[i] = y[i] * dn_sigmoid(y[i]);
        return;
    }
#ifdef SS_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(y + i);
        _mm256_storeu_ps(y + i, _mm256_div_ps(v, _mm256_add_ps(one, exp_avx2(_mm256_xor_ps(v, neg)))));
    }
#endif
    for (; i < n; i++) {
        const float v = y[i], den = 1.0f + exp_scalar(-v);
        y[i] = v / den;
    }
}

/* conv + SiLU over rows 0..n-1: xx [W + n, C] (window then rows), wt [K, C] -> y [n, C]; the threads
   split rows and channels in pieces of DN_CONV_CHANNELS (so a one-row decode step is split too) */
#ifndef DN_CONV_CHANNELS
#define DN_CONV_CHANNELS 1024
#endif
static void SS_NOCONTRACT dn_conv(const float *xx, const float *wt, int64_t n, int64_t C, int64_t K, float *y,
                                  int nthreads) {
    const int64_t pieces = (C + DN_CONV_CHANNELS - 1) / DN_CONV_CHANNELS;
    const int par = nthreads > 1 && n * C > 4096;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t tp = 0; tp < n * pieces; tp++) {
        const int64_t t = tp / pieces, c0 = tp % pieces * DN_CONV_CHANNELS;
        const int64_t c1 = c0 + DN_CONV_CHANNELS < C ? c0 + DN_CONV_CHANNELS : C;
        float *yr = y + t * C;
        for (int64_t c = c0; c < c1; c++) yr[c] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const float *xr = xx + (t + j) * C, *wr = wt + j * C;
            for (int64_t c = c0; c < c1; c++) yr[c] += wr[c] * xr[c];
        }
        dn_silu(yr + c0, c1 - c0);
    }
}

/* x *= scale / sqrt(sum x^2 + 1e-6) over d values */
static void SS_NOCONTRACT dn_l2norm(float *x, int64_t d, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < d; i++) x[i] = (x[i] * inv) * scale;
}

/* dst = src (n floats): a state read again only at a later step, after every other layer's weights
   have gone through the caches, so stored past them (streaming stores: no read of dst's lines first)
   where dst is aligned; the caller fences (_mm_sfence) before the states are read. */
#ifndef DN_STREAM
#define DN_STREAM 1
#endif
static void dn_store(float *dst, const float *src, int64_t n) {
    int64_t i = 0;
#if !DN_STREAM
#elif defined(SS_AVX512)
    if (((uintptr_t)dst & 63) == 0)
        for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#elif defined(SS_AVX2)
    if (((uintptr_t)dst & 31) == 0)
        for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
    if (i < n) memcpy(dst + i, src + i, (size_t)(n - i) * sizeof(float));
}

/* one value head through n rows; S [dk, dv] in place, starting from S0 (read by the first row's
   decay pass, not copied first) or, with S0 NULL, from S as it is */
static void SS_NOCONTRACT dn_head(float *S, const float *S0, const float *y, int64_t C, int64_t n, int64_t dk,
                                  int64_t dv, int64_t qoff, int64_t koff, int64_t voff, const float *decay,
                                  const float *beta, int64_t ldg, float *out, int64_t ldo, float *const *state_out,
                                  int64_t soff, float *mem) {
    for (int64_t t = 0; t < n; t++) {
        const float *q = y + t * C + qoff, *k = y + t * C + koff, *v = y + t * C + voff;
        const float dec = decay[t * ldg], b = beta[t * ldg];
        const float *from = t == 0 && S0 ? S0 : S;
        for (int64_t j = 0; j < dv; j++) mem[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv;
            const float *src = from + i * dv, ki = k[i];
            for (int64_t j = 0; j < dv; j++) {
                row[j] = src[j] * dec;
                mem[j] += row[j] * ki;
            }
        }
        for (int64_t j = 0; j < dv; j++) mem[j] = (v[j] - mem[j]) * b; /* delta */
        float *o = out + t * ldo;
        for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv;
            const float ki = k[i], qi = q[i];
            for (int64_t j = 0; j < dv; j++) {
                row[j] += ki * mem[j];
                o[j] += row[j] * qi;
            }
        }
        if (state_out && state_out[t]) dn_store(state_out[t] + soff, S, dk * dv);
    }
}

/* qkv [n, C] (row stride ld_qkv) with C = 2 Hk dk + Hv dv: q heads, k heads, v heads; a, b [n, Hv]
 * (row stride ld_ab); conv_wt [K, C]; A (= -exp(A_log)), dt_bias [Hv]; conv_in [K-1, C] and
 * state_in [Hv, dk, dv] (NULL: zeros); conv_out / state_out: n pointers each (or NULL), row t's
 * entry non-NULL to receive the window / state after row t; out [n, Hv, dv]. v_tiled: value head h
 * reads key head h % Hk (llama.cpp's tiled order), else h / (Hv / Hk) (grouped, as checkpoints). */
SS_EXPORT int SS_NOCONTRACT ss_gated_delta(int64_t n, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t K,
                                           const float *qkv, int64_t ld_qkv, const float *a, const float *b,
                                           int64_t ld_ab, const float *conv_wt, const float *A,
                                           const float *dt_bias, const float *conv_in, const float *state_in,
                                           float *const *conv_out, float *const *state_out, float *out,
                                           int v_tiled, int nthreads) {
    if (n < 0 || Hk <= 0 || Hv <= 0 || Hv % Hk || dk <= 0 || dv <= 0 || K < 1) return SS_EINVAL;
    const int64_t C = 2 * Hk * dk + Hv * dv, W = K - 1;
    if (ld_qkv < C || ld_ab < Hv) return SS_EINVAL;
    if (n == 0) return SS_OK;
    nthreads = resolve_threads(nthreads);
    float *xx = malloc((size_t)((W + n) * C) * sizeof(float));
    float *y = malloc((size_t)(n * C) * sizeof(float));
    float *g = malloc((size_t)(2 * n * Hv) * sizeof(float));
    if (!xx || !y || !g) {
        free(xx), free(y), free(g);
        return SS_ENOMEM;
    }
    if (W) {
        if (conv_in) memcpy(xx, conv_in, (size_t)(W * C) * sizeof(float));
        else memset(xx, 0, (size_t)(W * C) * sizeof(float));
    }
    for (int64_t t = 0; t < n; t++) memcpy(xx + (W + t) * C, qkv + t * ld_qkv, (size_t)C * sizeof(float));
    dn_conv(xx, conv_wt, n, C, K, y, nthreads);
    const float qscale = 1.0f / sqrtf((float)dk);
    float *decay = g, *beta = g + n * Hv;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t h = 0; h < Hk; h++) {
            dn_l2norm(y + t * C + h * dk, dk, qscale);
            dn_l2norm(y + t * C + (Hk + h) * dk, dk, 1.0f);
        }
        for (int64_t h = 0; h < Hv; h++) {
            decay[t * Hv + h] = expf(A[h] * dn_softplus(a[t * ld_ab + h] + dt_bias[h]));
            beta[t * Hv + h] = dn_sigmoid(b[t * ld_ab + h]);
        }
    }
    for (int64_t t = 0; t < n && conv_out; t++)
        if (conv_out[t] && W) memcpy(conv_out[t], xx + (t + 1) * C, (size_t)(W * C) * sizeof(float));
    const int64_t rep = Hv / Hk, S_len = dk * dv;
    int rc = SS_OK;
    const int par = nthreads > 1 && Hv > 1;
#pragma omp parallel num_threads(nthreads) if (par)
    {
        float *S = malloc((size_t)(S_len + dv) * sizeof(float));
        if (!S) {
#pragma omp atomic write
            rc = SS_ENOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < Hv; h++) {
            if (!S) continue;
            if (!state_in) memset(S, 0, (size_t)S_len * sizeof(float));
            const int64_t kh = v_tiled ? h % Hk : h / rep; /* llama.cpp's order / the checkpoint's */
            dn_head(S, state_in ? state_in + h * S_len : NULL, y, C, n, dk, dv, kh * dk, (Hk + kh) * dk,
                    2 * Hk * dk + h * dv, decay + h, beta + h, Hv, out + h * dv, Hv * dv, state_out, h * S_len,
                    S + S_len);
        }
        free(S);
    }
#if defined(SS_AVX2)
    _mm_sfence(); /* the streaming stores of dn_store, before anyone reads the states */
#endif
    free(xx), free(y), free(g);
    return rc;
}

/* out = x * sigmoid(gate) over M rows of N (row strides ldg, ldx; out contiguous): the output
 * gate of gated attention, elementwise with libm's expf (the same bits in every build). */
SS_EXPORT int SS_NOCONTRACT ss_sigmoid_mul(const float *gate, const float *x, int64_t M, int64_t N, int64_t ldg,
                                           int64_t ldx, float *out, int nthreads) {
    if (M < 0 || N <= 0 || ldg < N || ldx < N) return SS_EINVAL;
    nthreads = resolve_threads(nthreads);
    const int par = nthreads > 1 && M > 1 && (double)M * (double)N > 65536.0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < N; j++) out[m * N + j] = x[m * ldx + j] * dn_sigmoid(gate[m * ldg + j]);
    return SS_OK;
}
