/* A mixture of experts' last step: each row's expert outputs weighted and summed in one fixed
 * order, and the shared expert behind its sigmoid gate added last. The experts' outputs are rows
 * of Y [R, N], picked by idx [M, K (+1 with a shared expert)]:
 *
 * out[m] = (((w[m,0] Y[idx[m,0]] + w[m,1] Y[idx[m,1]]) + ...) + w[m,K-1] Y[idx[m,K-1]])
 *          + Y[idx[m,K]] sigmoid(gate[m])
 *
 * Every product is rounded before its sum (SS_NOCONTRACT, -ffp-contract=off), so a row's bits are
 * those of the same steps in torch one expert at a time (out[rows] += y * w, then + x * sigmoid(g)
 * as ss_sigmoid_mul computes it), whatever M and the thread count. */

SS_EXPORT int SS_NOCONTRACT ss_moe_combine(const float *Y, int64_t R, const int64_t *idx, const float *w,
                                           int64_t M, int64_t K, int64_t N, const float *gate, float *out,
                                           int nthreads) {
    if (M < 0 || K <= 0 || N <= 0 || R < 0) return SS_EINVAL;
    const int64_t ks = K + (gate != NULL);
    for (int64_t i = 0; i < M * ks; i++)
        if (idx[i] < 0 || idx[i] >= R) return SS_EINVAL;
    nthreads = resolve_threads(nthreads);
    const int par = nthreads > 1 && M > 1 && (double)M * (double)ks * (double)N > 65536.0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * N;
        const int64_t *im = idx + m * ks;
        const float *wm = w + m * K, *y = Y + im[0] * N;
        for (int64_t j = 0; j < N; j++) o[j] = wm[0] * y[j];
        for (int64_t e = 1; e < K; e++) {
            y = Y + im[e] * N;
            for (int64_t j = 0; j < N; j++) o[j] = o[j] + wm[e] * y[j];
        }
        if (gate) {
            const float s = dn_sigmoid(gate[m]);
            y = Y + im[K] * N;
            for (int64_t j = 0; j < N; j++) o[j] = o[j] + y[j] * s;
        }
    }
    return SS_OK;
}

/* A mixture of experts' routing, one row at a time: logits [M, E] (row stride ld) -> the K experts
 * of largest logit (ties: the lower index), each row's in ascending order in chosen [M, K], and their
 * softmax probabilities in w [M, K] (renorm: divided by their sum, added in descending order). The
 * softmax sums exp(l - max) over the experts in index order. K <= 64. */
SS_EXPORT int SS_NOCONTRACT ss_moe_route(const float *logits, int64_t M, int64_t E, int64_t ld, int64_t K, int renorm,
                                         float *w, int64_t *chosen) {
    if (M < 0 || E <= 0 || K <= 0 || K > E || K > 64 || ld < E) return SS_EINVAL;
    for (int64_t m = 0; m < M; m++) {
        const float *l = logits + m * ld;
        float mx = -INFINITY, sum = 0.0f, top[64], p[64], s = 0.0f;
        int64_t id[64], n = 0;
        for (int64_t e = 0; e < E; e++) mx = fmaxf(mx, l[e]);
        for (int64_t e = 0; e < E; e++) {
            sum += expf(l[e] - mx);
            if (isnan(l[e]) || (n == K && !(l[e] > top[K - 1]))) continue;
            int64_t j = n < K ? n++ : K - 1;
            for (; j > 0 && l[e] > top[j - 1]; j--) top[j] = top[j - 1], id[j] = id[j - 1];
            top[j] = l[e], id[j] = e;
        }
        if (n < K) return SS_EINVAL; /* fewer than K experts with a number for a logit */
        for (int64_t j = 0; j < K; j++) p[j] = expf(top[j] - mx) / sum;
        if (renorm) {
            for (int64_t j = 0; j < K; j++) s += p[j];
            for (int64_t j = 0; j < K; j++) p[j] = p[j] / s;
        }
        for (int64_t j = 1; j < K; j++) /* by expert, ascending */
            for (int64_t i = j; i > 0 && id[i] < id[i - 1]; i--) {
                const int64_t t = id[i]; id[i] = id[i - 1], id[i - 1] = t;
                const float u = p[i]; p[i] = p[i - 1], p[i - 1] = u;
            }
        memcpy(w + m * K, p, (size_t)K * sizeof(float));
        memcpy(chosen + m * K, id, (size_t)K * sizeof(int64_t));
    }
    return SS_OK;
}
