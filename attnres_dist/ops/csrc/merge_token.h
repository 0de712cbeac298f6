/* One token of phase 2, forward and backward, shared by merge_cpu.c and merge_norm_cpu.c: the
 * two-way merge (one extra source, Block's partial) and the general one (m extra sources e_k,
 * rows rs floats apart: Full AttnRes's group outputs). Per-token statistics are written at
 * stats[k * T] (the caller passes stats + t). */
#ifndef ATTNRES_DIST_MERGE_TOKEN_H
#define ATTNRES_DIST_MERGE_TOKEN_H

#include "vector_math.h"

/* Rows of [rows, T] statistics a merge of m extras saves: a, le, r (m == 1), or le_k, r_k and
 * the total (m > 1). */
static inline int64_t merge_stat_rows(int m) { return m == 1 ? 3 : 2 * (int64_t)m + 1; }

/* y = lerp(o1, e, a): the two-way merge's row for weight a. */
INLINE void merge1_token_mix(const float *ot, const float *et, float a, int D, float *y) {
#pragma omp simd
    for (int d = 0; d < D; ++d) y[d] = ot[d] + a * (et[d] - ot[d]);
}

/* y = lerp(o1, e, a), a = sigmoid(le - lse), le = r <e, u>; a, le, r to stats[0, T, 2 T]. */
INLINE void merge1_token_forward(const float *ot, float lse, const float *et, const float *u,
                                 int D, float eps, float *y, float *stats, int64_t T) {
    float r, le;
    token_logits(et, 0, 1, D, u, eps, &r, &le);
    const float a = 1.0f / (1.0f + expf(lse - le));
    merge1_token_mix(ot, et, a, D, y);
    stats[0] = a, stats[T] = le, stats[2 * T] = r;
}

/* g: the output's gradient. d a = <g, e - o1>, d le = a (1 - a) d a; d o1 = g (1 - a),
 * d lse = -d le, d e = g a + r d le u - r^2 / D d le le e (added to ge when accumulate);
 * du += r d le e. go1 / ge may be NULL. */
INLINE void merge1_token_backward(const float *ot, const float *et, const float *u, float a,
                                  float le, float r, const float *g, int D, float *go1,
                                  float *glse, float *ge, int accumulate, float *du) {
    const float *rows[2] = {et, ot};
    float ge_go[2];
    dotsq(g, rows, D, 2, ge_go, 0, 0);
    const float da = ge_go[0] - ge_go[1];
    const float dle = a * (1.0f - a) * da;
    const float draw = dle * r;
    const float coef = -(r * r / (float)D) * dle * le;
    *glse = -dle;
    if (go1) {
#pragma omp simd
        for (int d = 0; d < D; ++d) go1[d] = g[d] * (1.0f - a);
    }
    if (ge) {
        if (accumulate) {
#pragma omp simd
            for (int d = 0; d < D; ++d) ge[d] += g[d] * a + draw * u[d] + coef * et[d];
        } else {
#pragma omp simd
            for (int d = 0; d < D; ++d) ge[d] = g[d] * a + draw * u[d] + coef * et[d];
        }
    }
#pragma omp simd
    for (int d = 0; d < D; ++d) du[d] += draw * et[d];
}

/* y = a0 o1 + sum_k a_k e_k with a0 = exp(lse - total), a_k = exp(le_k - total) (le_k at
 * le[k * ls]); a[k] = a_k. */
INLINE void merge_token_mix(const float *ot, float lse, const float *et, int64_t rs,
                            const float *le, int64_t ls, float total, int m, int D, float *y,
                            float *a) {
    const float a0 = expf(lse - total);
#pragma omp simd
    for (int d = 0; d < D; ++d) y[d] = a0 * ot[d];
    for (int k = 0; k < m; ++k) {
        const float ak = expf(le[k * ls] - total);
        const float *x = et + k * rs;
#pragma omp simd
        for (int d = 0; d < D; ++d) y[d] += ak * x[d];
        a[k] = ak;
    }
}

/* le_k = r_k <e_k, u>, total = logaddexp(lse, logsumexp_k le_k), y the mix; le_k and r_k to
 * stats[k T] and stats[(m + k) T], total to stats[2 m T]. */
INLINE void merge_token_forward(const float *ot, float lse, const float *et, int64_t rs,
                                const float *u, int m, int D, float eps, float *y, float *stats,
                                int64_t T) {
    float r[m], le[m], a[m];
    token_logits(et, rs, m, D, u, eps, r, le);
    float mx = lse;
    for (int k = 0; k < m; ++k) mx = fmaxf(mx, le[k]);
    float s = expf(lse - mx);
    for (int k = 0; k < m; ++k) s += expf(le[k] - mx);
    const float total = mx + logf(s);
    merge_token_mix(ot, lse, et, rs, le, 1, total, m, D, y, a);
    for (int k = 0; k < m; ++k) stats[k * T] = le[k], stats[(m + k) * T] = r[k];
    stats[2 * m * T] = total;
}

/* d a0 = <g, o1>, d a_k = <g, e_k>, c = a0 d a0 + sum_k a_k d a_k; d lse = a0 (d a0 - c),
 * d le_k = a_k (d a_k - c); d o1 = a0 g; d e_k = a_k g + r_k d le_k u - r_k^2 / D d le_k le_k e_k
 * (ge's rows rs apart); du += sum_k r_k d le_k e_k. stats as merge_token_forward wrote them. */
INLINE void merge_token_backward(const float *ot, float lse, const float *et, int64_t rs,
                                 const float *u, const float *stats, int64_t T, int m,
                                 const float *g, int D, float *go1, float *glse, float *ge,
                                 int accumulate, float *du) {
    float a[m], dg[m + 1]; /* dg = <g, o1>, then <g, e_k> */
    const float *rows[m + 1];
    rows[0] = ot;
    for (int k = 0; k < m; ++k) rows[k + 1] = et + k * rs;
    dots(g, rows, m + 1, D, dg);
    const float *dle = dg + 1;
    const float total = stats[2 * m * T];
    const float a0 = expf(lse - total), da0 = dg[0];
    float c = a0 * da0;
    for (int k = 0; k < m; ++k) {
        a[k] = expf(stats[k * T] - total);
        c += a[k] * dle[k];
    }
    *glse = a0 * (da0 - c);
    if (go1) {
#pragma omp simd
        for (int d = 0; d < D; ++d) go1[d] = a0 * g[d];
    }
    for (int k = 0; k < m; ++k) {
        const float dl = a[k] * (dle[k] - c), r = stats[(m + k) * T], le = stats[k * T];
        const float draw = dl * r, coef = -(r * r / (float)D) * dl * le;
        const float *x = et + k * rs;
        if (ge) {
            float *y = ge + k * rs;
            const float ak = a[k];
            if (accumulate) {
#pragma omp simd
                for (int d = 0; d < D; ++d) y[d] += ak * g[d] + draw * u[d] + coef * x[d];
            } else {
#pragma omp simd
                for (int d = 0; d < D; ++d) y[d] = ak * g[d] + draw * u[d] + coef * x[d];
            }
        }
#pragma omp simd
        for (int d = 0; d < D; ++d) du[d] += draw * x[d];
    }
}

#endif
