/* One thread (or NT threads, each over its own half) calling the panel kernel of linear_panel.h
   (pq_rows) for RR rows over NPAN panels of 16 channels x 1536 inputs, back to back: NPAN 16 keeps
   them in L2 (the kernel's arithmetic alone), NPAN 8192 streams 116 MB (Q4_K) from memory in huge
   pages, as the model's weights are. Prints ns per panel call and int8 dot instructions per ns.
   Built by panel_calls.sh against a copy of specserve/kernels/csrc. With KNP=2: two panels per call
   (pq_rows' two-panel pass); NEW=1: results_final/zen5_1206c/q4k_pair.h's kernel instead (IL=1: the
   pair's super-blocks interleaved in one stream; that directory on the include path), as
   zen5_1206c/kernel_experiments.sh builds it. */
#include <sys/mman.h>
#include <stdio.h>
#include <time.h>
#include <omp.h>
#include "cpu_kernels.c"
#if NEW
#include "q4k_pair.h"
#endif
#ifndef IL
#define IL 0
#endif
#ifndef KNP
#define KNP 1
#endif
#ifndef NPAN
#define NPAN 16
#endif
#ifndef NT
#define NT 1
#endif
#ifndef RR
#define RR 8
#endif
#ifndef FMT
#define FMT FMT_Q4_K
#endif
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
__attribute__((noinline)) static void kern(const uint8_t *xb, const PXLay *L, const uint8_t *pp, int64_t ps,
                                           int64_t K, float *out) {
    #if NEW
    if (RR == 1) pq_q4k2(1, xb, L, pp, IL ? 2368 : ps, IL ? 4736 : 2368, K, out);
    else if (RR == 2) pq_q4k2(2, xb, L, pp, IL ? 2368 : ps, IL ? 4736 : 2368, K, out);
    else if (RR == 4) pq_q4k2(4, xb, L, pp, IL ? 2368 : ps, IL ? 4736 : 2368, K, out);
    else pq_q4k2(8, xb, L, pp, IL ? 2368 : ps, IL ? 4736 : 2368, K, out);
#else
    pq_rows(FMT, RR, KNP, xb, L, pp, ps, K, out);
#endif
    __asm__ volatile("" :: "r"(out) : "memory");
}
int main(void) {
    const int64_t K = 1536, NP = NPAN;
    PXLay L;
    px_layout(FMT, K, &L);
    const int64_t pst = K / panel_act_block(FMT) * panel_block_bytes(FMT), bytes = ((pst * NP) >> 21 << 21) + (2 << 20);
    uint8_t *pw = aligned_alloc(2 << 20, bytes), *xb = aligned_alloc(64, RR * L.stride);
    madvise(pw, bytes, MADV_HUGEPAGE);
    for (int64_t i = 0; i < pst * NP; i++) pw[i] = (uint8_t)(i * 7 + 3);
    float x[1536];
    for (int i = 0; i < K; i++) x[i] = sinf(i);
    for (int r = 0; r < RR; r++) px_row(FMT, x, K, xb + r * L.stride, &L);
    const long n = 200000 / RR;
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        const double t0 = now();
#pragma omp parallel num_threads(NT)
        {
            float out[2 * QP_R * 16] __attribute__((aligned(64)));
            const int t = omp_get_thread_num();
            for (long i = 0; i < n; i++) kern(xb, &L, pw + pst * KNP * ((i % (NP / NT / KNP)) + t * (NP / NT / KNP)), pst, K, out);
        }
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    printf("fmt %d, %d rows, %d panels, %d threads: %.1f ns per panel call, %.2f int8 dots per ns a thread\n", FMT,
           RR, NPAN, NT, best / n * 1e9, (double)n * RR * KNP * K / 4 / best / 1e9);
    return 0;
}
