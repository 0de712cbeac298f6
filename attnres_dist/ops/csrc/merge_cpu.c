/* Phase 2 of two-phase depth attention, forward and backward, fused per token (merge_token.h):
 * one sublayer's phase-1 result merged with the sources not in the store by online softmax,
 * for one extra source (the Block partial: a two-way softmax) and for several (Full AttnRes's
 * group outputs). merge_norm_cpu.c fuses the sublayer's RMSNorm after them.
 */
#include "merge_token.h"

/* stats [3, T]: a, le, r. */
int merge1_fwd(const float *o1, const float *lse, const float *e, const float *q, const float *g,
               int64_t T, int D, float eps, float *out, float *stats, int threads) {
    float *u = products(q, g, 1, 1, D);
    if (!u) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t)
        merge1_token_forward(o1 + t * D, lse[t], e + t * D, u, D, eps, out + t * D, stats + t, T);
    free(u);
    return 0;
}

/* accumulate: ge += d e (a gradient buffer other readers add to); dL/du per thread. */
int merge1_bwd(const float *o1, const float *e, const float *q, const float *g,
               const float *stats, const float *G, int64_t T, int D, float *go1, float *glse,
               float *ge, int accumulate, float *gq, float *gg, int threads) {
    BackwardWork w;
    const int ok = work_alloc(&w, q, g, 1, 1, D, threads);
    if (ok) {
#pragma omp parallel num_threads(threads)
        {
            float *du = w.du + (int64_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t)
                merge1_token_backward(o1 + t * D, e + t * D, w.u, stats[t], stats[T + t],
                                      stats[2 * T + t], G + t * D, D, go1 ? go1 + t * D : 0,
                                      glse + t, ge ? ge + t * D : 0, accumulate, du);
        }
    }
    return work_finish(&w, ok, threads, 1, 1, D, q, g, gq, gg);
}

/* m extra sources ([m, T, D]); stats [2 m + 1, T]: le, r, total. */
int merge_fwd(const float *o1, const float *lse, const float *e, const float *q, const float *g,
              int m, int64_t T, int D, float eps, float *out, float *stats, int threads) {
    float *u = products(q, g, 1, 1, D);
    if (!u) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t)
        merge_token_forward(o1 + t * D, lse[t], e + t * D, T * D, u, m, D, eps, out + t * D,
                            stats + t, T);
    free(u);
    return 0;
}

int merge_bwd(const float *o1, const float *lse, const float *e, const float *q, const float *g,
              const float *stats, const float *G, int m, int64_t T, int D, float *go1,
              float *glse, float *ge, int accumulate, float *gq, float *gg, int threads) {
    BackwardWork w;
    const int ok = work_alloc(&w, q, g, 1, 1, D, threads);
    if (ok) {
#pragma omp parallel num_threads(threads)
        {
            float *du = w.du + (int64_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t)
                merge_token_backward(o1 + t * D, lse[t], e + t * D, T * D, w.u, stats + t, T, m,
                                     G + t * D, D, go1 ? go1 + t * D : 0, glse + t,
                                     ge ? ge + t * D : 0, accumulate, du);
        }
    }
    return work_finish(&w, ok, threads, 1, 1, D, q, g, gq, gg);
}
