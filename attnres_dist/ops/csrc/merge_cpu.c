/* Phase 2 of two-phase depth attention, forward and backward, over tiles of VW tokens
 * (merge_token.h): one sublayer's phase-1 result merged with the sources not in the store by
 * online softmax, for one extra source (the Block partial: a two-way softmax) and for several
 * (Full AttnRes's group outputs). merge_norm_cpu.c fuses the sublayer's RMSNorm after them.
 */
#include "merge_token.h"

/* stats [3, T]: a, le, r. */
int merge1_fwd(const float *o1, const float *lse, const float *e, const float *q, const float *g,
               int64_t T, int D, float eps, float *out, float *stats, int threads) {
    float *u = products(q, g, 1, 1, D);
    if (!u) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < TILES(T); ++k) {
        const int64_t t0 = k * VW;
        merge1_tile_forward(o1 + t0 * D, lse, e + t0 * D, u, t0, TILE_TOKENS(T, k), D, eps,
                            out + t0 * D, stats, T);
    }
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
            for (int64_t k = 0; k < TILES(T); ++k) {
                const int64_t t0 = k * VW;
                merge1_tile_backward(o1 + t0 * D, e + t0 * D, w.u, stats, t0, TILE_TOKENS(T, k),
                                     T, G + t0 * D, D, go1 ? go1 + t0 * D : 0, glse,
                                     ge ? ge + t0 * D : 0, accumulate, du);
            }
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
    for (int64_t k = 0; k < TILES(T); ++k) {
        const int64_t t0 = k * VW;
        merge_tile_forward(o1 + t0 * D, lse, e + t0 * D, T * D, u, m, t0, TILE_TOKENS(T, k), D,
                           eps, out + t0 * D, stats, T);
    }
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
            for (int64_t k = 0; k < TILES(T); ++k) {
                const int64_t t0 = k * VW;
                merge_tile_backward(o1 + t0 * D, lse, e + t0 * D, T * D, w.u, stats, t0,
                                    TILE_TOKENS(T, k), T, m, G + t0 * D, D,
                                    go1 ? go1 + t0 * D : 0, glse, ge ? ge + t0 * D : 0,
                                    accumulate, du);
            }
        }
    }
    return work_finish(&w, ok, threads, 1, 1, D, q, g, gq, gg);
}
