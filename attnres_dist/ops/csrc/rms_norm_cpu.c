/* RMSNorm forward and backward, fused per token (norm_token.h): y = x r w with
 * r = rsqrt(mean(x^2) + eps), x and y [T, D], w [D]. The forward saves r ([T]); the backward
 * recomputes x r from it. Torch's CPU rms_norm runs as about ten elementwise ops under
 * autograd, each a pass over [T, D].
 */
#include "norm_token.h"

int rms_norm_fwd(const float *x, const float *w, int64_t T, int D, float eps, float *y,
                 float *r, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) r[t] = norm_token_forward(x + t * D, w, D, eps, y + t * D);
    return 0;
}

/* gw may be NULL (the gain needs no gradient); -1 when the work buffer cannot be allocated. */
int rms_norm_bwd(const float *x, const float *w, const float *r, const float *G, int64_t T,
                 int D, float *gx, float *gw, int threads) {
    float *part = calloc((size_t)threads * D, sizeof(float));
    if (!part) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *gw_t = part + (int64_t)omp_get_thread_num() * D;
        /* split by tiles of VW tokens, as merge_norm_cpu.c does: each thread's part of the gain's
         * gradient sums the same tokens in the same order, so the fused kernel's equals this */
#pragma omp for schedule(static)
        for (int64_t k = 0; k < TILES(T); ++k)
            for (int64_t t = k * VW; t < k * VW + TILE_TOKENS(T, k); ++t)
                norm_token_backward(x + t * D, w, r[t], G + t * D, D, gx + t * D, gw_t);
    }
    sum_parts(part, threads, D, gw);
    free(part);
    return 0;
}
