/* One token of RMSNorm, forward and backward, shared by rms_norm_cpu.c and merge_norm_cpu.c
 * (the same arithmetic, so a fused caller's result is the standalone kernel's):
 * y = x r w with r = rsqrt(mean(x^2) + eps); backward with xh = x r, h = G w:
 * dx = r (h - xh mean(h xh)), and the gain's gradient G xh added to gw (a thread's part). */
#ifndef ATTNRES_DIST_NORM_TOKEN_H
#define ATTNRES_DIST_NORM_TOKEN_H

#include "vector_math.h"

/* y = x r w; returns r. */
INLINE float norm_token_forward(const float *x, const float *w, int D, float eps, float *y) {
    const float r = 1.0f / sqrtf(dot(x, x, D) / (float)D + eps);
    int d = 0;
    for (; d + VW <= D; d += VW) vstore(y + d, vload(x + d) * r * vload(w + d));
    for (; d < D; ++d) y[d] = x[d] * r * w[d];
    return r;
}

INLINE void norm_token_backward(const float *x, const float *w, float r, const float *g, int D,
                                float *gx, float *gw) {
    vf acc = {0};
    int d = 0;
    for (; d + VW <= D; d += VW) acc += vload(g + d) * vload(w + d) * vload(x + d);
    float s = vsum(acc);
    for (; d < D; ++d) s += g[d] * w[d] * x[d];
    const float c = s * r * r / (float)D; /* mean(h xh) r = <h, x> r^2 / D */
    for (d = 0; d + VW <= D; d += VW) {
        const vf xv = vload(x + d), gv = vload(g + d);
        vstore(gx + d, (gv * vload(w + d) - xv * c) * r);
        vstore(gw + d, vload(gw + d) + gv * xv * r);
    }
    for (; d < D; ++d) {
        gx[d] = (g[d] * w[d] - x[d] * c) * r;
        gw[d] += g[d] * x[d] * r;
    }
}

/* Sums the threads' parts of the gain's gradient in thread order into gw (when not NULL). */
static inline void sum_parts(const float *part, int threads, int D, float *gw) {
    for (int d = 0; gw && d < D; ++d) {
        float s = 0.f;
        for (int k = 0; k < threads; ++k) s += part[(int64_t)k * D + d];
        gw[d] = s;
    }
}

#endif
