/* Phase 2 followed by the sublayer's RMSNorm with gain w, fused over tiles of VW tokens: the
 * sublayer reads norm(merge(...)) and nothing else reads the merged rows h, so they stay in a
 * per-thread buffer (forward) and are formed again from the saved weights (backward) instead of
 * being written and read back. The merge and the norm are merge_token.h's and norm_token.h's,
 * as in the standalone kernels, so the results are theirs. Statistics: the merge's
 * (merge_cpu.c), then rn ([T]), the norm's reciprocal RMS.
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
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *h = malloc((size_t)VW * D * sizeof(float)); /* the tile's merged rows */
        failed = !h;
#pragma omp for schedule(static)
        for (int64_t k = 0; k < TILES(T); ++k) {
            if (!h) continue;
            const int64_t t0 = k * VW;
            const int tt = TILE_TOKENS(T, k);
            if (m == 1)
                merge1_tile_forward(o1 + t0 * D, lse, e + t0 * D, u, t0, tt, D, eps, h, stats, T);
            else
                merge_tile_forward(o1 + t0 * D, lse, e + t0 * D, T * D, u, m, t0, tt, D, eps, h,
                                   stats, T);
            for (int i = 0; i < tt; ++i)
                stats[rn_row + t0 + i] =
                    norm_token_forward(h + (int64_t)i * D, w, D, norm_eps, y + (t0 + i) * D);
        }
        free(h);
    }
    free(u);
    return failed ? -1 : 0;
}

/* gw (the norm gain's gradient) may be NULL, like gq and gg; lse is read for m > 1 only. */
int merge_norm_bwd(const float *o1, const float *lse, const float *e, const float *q,
                   const float *g, const float *w, const float *stats, const float *G, int m,
                   int64_t T, int D, float *go1, float *glse, float *ge, int accumulate,
                   float *gq, float *gg, float *gw, int threads) {
    BackwardWork work;
    float *gw_part = calloc((size_t)threads * D, sizeof(float));
    int ok = work_alloc(&work, q, g, 1, 1, D, threads) && gw_part;
    const int64_t rn_row = merge_stat_rows(m) * T;
    if (ok) {
        int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
            float *du = work.du + (int64_t)omp_get_thread_num() * D;
            float *gw_t = gw_part + (int64_t)omp_get_thread_num() * D;
            float *h = malloc((size_t)2 * VW * D * sizeof(float)), *dh = h + (int64_t)VW * D;
            failed = !h;
#pragma omp for schedule(static)
            for (int64_t k = 0; k < TILES(T); ++k) {
                if (!h) continue;
                const int64_t t0 = k * VW;
                const int tt = TILE_TOKENS(T, k);
                const float *ot = o1 + t0 * D, *et = e + t0 * D;
                if (m == 1) {
                    float a[VW];
                    vstore(a, vload_lanes(stats, t0, tt));
                    merge1_tile_mix(ot, et, a, tt, D, h);
                } else {
                    vf a[m + 1];
                    float aw[(m + 1) * VW];
                    merge_tile_weights(lse, stats, t0, tt, T, m, a);
                    for (int j = 0; j <= m; ++j) vstore(aw + j * VW, a[j]);
                    merge_tile_mix(ot, et, T * D, m, aw, tt, D, h);
                }
                for (int i = 0; i < tt; ++i) {
                    const int64_t o = (int64_t)i * D;
                    norm_token_backward(h + o, w, stats[rn_row + t0 + i], G + t0 * D + o, D,
                                        dh + o, gw_t);
                }
                float *go = go1 ? go1 + t0 * D : 0, *gt = ge ? ge + t0 * D : 0;
                if (m == 1)
                    merge1_tile_backward(ot, et, work.u, stats, t0, tt, T, dh, D, go, glse, gt,
                                         accumulate, du);
                else
                    merge_tile_backward(ot, lse, et, T * D, work.u, stats, t0, tt, T, m, dh, D,
                                        go, glse, gt, accumulate, du);
            }
            free(h);
        }
        ok = !failed;
        if (ok) sum_parts(gw_part, threads, D, gw);
    }
    free(gw_part);
    return work_finish(&work, ok, threads, 1, 1, D, q, g, gq, gg);
}
