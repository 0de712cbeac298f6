/* RMSNorm forward and backward, fused per token: y = x r w with r = rsqrt(mean(x^2) + eps),
 * x and y [T, D], w [D]. The forward saves r ([T]); the backward recomputes x r from it. Torch's
 * CPU rms_norm runs as about ten elementwise ops under autograd, each a pass over [T, D].
 */
#include "vector_math.h"

static void rms_norm_forward(const float *x, const float *w, int64_t T, int D, float eps,
                             float *y, float *r_out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float *xt = x + t * D;
        float *yt = y + t * D;
        const float r = 1.0f / sqrtf(dot(xt, xt, D) / (float)D + eps);
        int d = 0;
        for (; d + VW <= D; d += VW) vstore(yt + d, vload(xt + d) * r * vload(w + d));
        for (; d < D; ++d) yt[d] = xt[d] * r * w[d];
        r_out[t] = r;
    }
}

/* xh = x r, h = G w: dx = r (h - xh mean(h xh)), dw = sum_t G xh (per-thread parts, summed in
 * thread order). */
static void rms_norm_backward(const float *x, const float *w, const float *r_in, const float *G,
                              int64_t T, int D, float *gx, float *gw_part, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *gw = gw_part + (int64_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const float *xt = x + t * D, *g = G + t * D;
            const float r = r_in[t];
            vf acc = {0};
            int d = 0;
            for (; d + VW <= D; d += VW) acc += vload(g + d) * vload(w + d) * vload(xt + d);
            float s = vsum(acc);
            for (; d < D; ++d) s += g[d] * w[d] * xt[d];
            const float c = s * r * r / (float)D; /* mean(h xh) r = <h, x> r^2 / D */
            float *y = gx + t * D;
            for (d = 0; d + VW <= D; d += VW) {
                const vf xv = vload(xt + d), gv = vload(g + d);
                vstore(y + d, (gv * vload(w + d) - xv * c) * r);
                vstore(gw + d, vload(gw + d) + gv * xv * r);
            }
            for (; d < D; ++d) {
                y[d] = (g[d] * w[d] - xt[d] * c) * r;
                gw[d] += g[d] * xt[d] * r;
            }
        }
    }
}

int rms_norm_fwd(const float *x, const float *w, int64_t T, int D, float eps, float *y,
                 float *r, int threads) {
    rms_norm_forward(x, w, T, D, eps, y, r, threads);
    return 0;
}

/* gw may be NULL (the gain needs no gradient); -1 when the work buffer cannot be allocated. */
int rms_norm_bwd(const float *x, const float *w, const float *r, const float *G, int64_t T,
                 int D, float *gx, float *gw, int threads) {
    float *part = calloc((size_t)threads * D, sizeof(float));
    if (!part) return -1;
    rms_norm_backward(x, w, r, G, T, D, gx, part, threads);
    for (int d = 0; gw && d < D; ++d) {
        float s = 0.f;
        for (int k = 0; k < threads; ++k) s += part[(int64_t)k * D + d];
        gw[d] = s;
    }
    free(part);
    return 0;
}
