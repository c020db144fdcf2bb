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
