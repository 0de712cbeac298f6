/* Phase 2 followed by the sublayer's RMSNorm with gain w, fused per token: the sublayer reads
 * norm(merge(...)) and nothing else reads the merged row h, so it stays in L1 (forward) and is
 * formed again from the saved weights (backward) instead of being written and read back. The
 * merge and the norm are merge_token.h's and norm_token.h's, as in the standalone kernels.
 * Statistics: the merge's (merge_cpu.c), then rn ([T]), the norm's reciprocal RMS.
 */
#include "merge_token.h"
#include "norm_token.h"

/* m == 1: the two-way merge (stats [4, T]); m > 1: the general one (stats [2 m + 2, T]). */
int merge_norm_fwd(const float *o1, const float *lse, const float *e, const float *q,
                   const float *g, const float *w, int m, int64_t T, int D, float eps,
                   float norm_eps, float *y, float *stats, int threads) {
    float *u = products(q, g, 1, 1, D);
    if (!u) return -1;
    const int64_t rn_row = merge_stat_rows(m) * T;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float h[D];
        if (m == 1)
            merge1_token_forward(o1 + t * D, lse[t], e + t * D, u, D, eps, h, stats + t, T);
        else
            merge_token_forward(o1 + t * D, lse[t], e + t * D, T * D, u, m, D, eps, h,
                                stats + t, T);
        stats[rn_row + t] = norm_token_forward(h, w, D, norm_eps, y + t * D);
    }
    free(u);
    return 0;
}

/* gw (the norm gain's gradient) may be NULL, like gq and gg; lse is read for m > 1 only. */
int merge_norm_bwd(const float *o1, const float *lse, const float *e, const float *q,
                   const float *g, const float *w, const float *stats, const float *G, int m,
                   int64_t T, int D, float *go1, float *glse, float *ge, int accumulate,
                   float *gq, float *gg, float *gw, int threads) {
    BackwardWork work;
    float *gw_part = calloc((size_t)threads * D, sizeof(float));
    const int ok = work_alloc(&work, q, g, 1, 1, D, threads) && gw_part;
    const int64_t rn_row = merge_stat_rows(m) * T;
    if (ok) {
#pragma omp parallel num_threads(threads)
        {
            float *du = work.du + (int64_t)omp_get_thread_num() * D;
            float *gw_t = gw_part + (int64_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) {
                const float *ot = o1 + t * D, *et = e + t * D;
                float h[D], dh[D], a[m];
                if (m == 1)
                    merge1_token_mix(ot, et, stats[t], D, h);
                else
                    merge_token_mix(ot, lse[t], et, T * D, stats + t, T, stats[2 * m * T + t],
                                    m, D, h, a);
                norm_token_backward(h, w, stats[rn_row + t], G + t * D, D, dh, gw_t);
                float *go = go1 ? go1 + t * D : 0, *gt = ge ? ge + t * D : 0;
                if (m == 1)
                    merge1_token_backward(ot, et, work.u, stats[t], stats[T + t],
                                          stats[2 * T + t], dh, D, go, glse + t, gt,
                                          accumulate, du);
                else
                    merge_token_backward(ot, lse[t], et, T * D, work.u, stats + t, T, m, dh, D,
                                         go, glse + t, gt, accumulate, du);
            }
        }
        sum_parts(gw_part, threads, D, gw);
    }
    free(gw_part);
    return work_finish(&work, ok, threads, 1, 1, D, q, g, gq, gg);
}
