/* Phase 2 over a tile of tt <= VW consecutive tokens, forward and backward, shared by
 * merge_cpu.c and merge_norm_cpu.c: the two-way merge (one extra source, Block's partial) and
 * the general one (m extra sources e_k, rows rs floats apart: Full AttnRes's group outputs).
 *
 * Each token's dot products are formed per row (over D in vector chunks); the per-token scalars
 * (key statistics, logits, softmax weights and their gradients) across the tile's tokens in
 * vector lanes, so no token waits on a scalar square root, exponential or logarithm; the mixes
 * and gradient rows per token again. Row pointers (o1, e, y, g, go1, ge) are at the tile's first
 * token, tokens D floats apart; lse, glse and the statistics ([rows, T], row k at stats[k T])
 * are whole arrays read and written at t0 .. t0 + tt - 1.
 */
#ifndef ATTNRES_DIST_MERGE_TOKEN_H
#define ATTNRES_DIST_MERGE_TOKEN_H

#include "vector_math.h"

/* Rows of [rows, T] statistics a merge of m extras saves: a, le, r (m == 1), or le_k, r_k and
 * the total (m > 1). */
static inline int64_t merge_stat_rows(int m) { return m == 1 ? 3 : 2 * (int64_t)m + 1; }

/* 1 / (1 + exp(-x)), exponentials of non-positive arguments only. */
static inline vf vsigmoid(vf x) {
    const vf one = (vf){0} + 1.0f;
    const vf ex = vexp(-vmax(x, -x));
    const vi pos = x >= 0.0f;
    return (vf)(((vi)one & pos) | ((vi)ex & ~pos)) / (one + ex);
}

/* r = rsqrt(mean(x_k^2) + eps) and le = r <x_k, u> of the tile's rows x_k of one source (rows
 * D apart, lanes past tt: le 0, r of a unit row). */
INLINE void tile_logits(const float *x, const float *u, int tt, int D, float eps, vf *r, vf *le) {
    const float *w[2] = {u, u};
    float dt[VW], sq[VW];
    for (int i = 0; i < VW; ++i) {
        float s[2];
        if (i < tt) dotsq(x + (int64_t)i * D, w, D, 2, s, sq + i, 0);
        else s[0] = 0.f, sq[i] = (float)D;
        dt[i] = s[0];
    }
    *r = vrsqrt_mean(vload(sq), D, eps);
    *le = *r * vload(dt);
}

/* y = lerp(o1, e, a) per token, a[i] token i's weight. */
INLINE void merge1_tile_mix(const float *ot, const float *et, const float *a, int tt, int D,
                            float *y) {
    for (int i = 0; i < tt; ++i) {
        const float *o = ot + (int64_t)i * D, *e = et + (int64_t)i * D;
        float *yt = y + (int64_t)i * D;
        const float ai = a[i];
#pragma omp simd
        for (int d = 0; d < D; ++d) yt[d] = o[d] + ai * (e[d] - o[d]);
    }
}

/* y = lerp(o1, e, a), a = sigmoid(le - lse), le = r <e, u>; a, le, r to stats[0, T, 2 T]. */
INLINE void merge1_tile_forward(const float *ot, const float *lse, const float *et,
                                const float *u, int64_t t0, int tt, int D, float eps, float *y,
                                float *stats, int64_t T) {
    vf r, le;
    tile_logits(et, u, tt, D, eps, &r, &le);
    const vf a = vsigmoid(le - vload_lanes(lse, t0, tt));
    vstore_lanes(stats, t0, tt, a);
    vstore_lanes(stats + T, t0, tt, le);
    vstore_lanes(stats + 2 * T, t0, tt, r);
    float av[VW];
    vstore(av, a);
    merge1_tile_mix(ot, et, av, tt, D, y);
}

/* g: the output's gradient. d a = <g, e - o1>, d le = a (1 - a) d a; d o1 = g (1 - a),
 * d lse = -d le, d e = g a + r d le u - r^2 / D d le le e (added to ge when accumulate);
 * du += r d le e. go1 / ge may be NULL. */
INLINE void merge1_tile_backward(const float *ot, const float *et, const float *u,
                                 const float *stats, int64_t t0, int tt, int64_t T,
                                 const float *g, int D, float *go1, float *glse, float *ge,
                                 int accumulate, float *du) {
    float da[VW];
    for (int i = 0; i < VW; ++i) {
        const int64_t o = (int64_t)i * D;
        const float *rows[2] = {et + o, ot + o};
        float ge_go[2] = {0.f, 0.f};
        if (i < tt) dotsq(g + o, rows, D, 2, ge_go, 0, 0);
        da[i] = ge_go[0] - ge_go[1];
    }
    const vf a = vload_lanes(stats, t0, tt), le = vload_lanes(stats + T, t0, tt);
    const vf r = vload_lanes(stats + 2 * T, t0, tt);
    const vf dle = a * (1.0f - a) * vload(da);
    float av[VW], drawv[VW], coefv[VW];
    vstore(av, a);
    vstore(drawv, dle * r);
    vstore(coefv, -(r * r / (float)D) * dle * le);
    vstore_lanes(glse, t0, tt, -dle);
    for (int i = 0; i < tt; ++i) {
        const int64_t o = (int64_t)i * D;
        const float *gt = g + o, *x = et + o;
        const float ai = av[i], draw = drawv[i], coef = coefv[i];
        if (go1) {
            float *z = go1 + o;
#pragma omp simd
            for (int d = 0; d < D; ++d) z[d] = gt[d] * (1.0f - ai);
        }
        if (ge) {
            float *z = ge + o;
            if (accumulate) {
#pragma omp simd
                for (int d = 0; d < D; ++d) z[d] += gt[d] * ai + draw * u[d] + coef * x[d];
            } else {
#pragma omp simd
                for (int d = 0; d < D; ++d) z[d] = gt[d] * ai + draw * u[d] + coef * x[d];
            }
        }
#pragma omp simd
        for (int d = 0; d < D; ++d) du[d] += draw * x[d];
    }
}

/* The general merge's weights across the tile: a[0] = exp(lse - total), a[1 + k] =
 * exp(le_k - total), from the statistics merge_tile_forward saved. */
INLINE void merge_tile_weights(const float *lse, const float *stats, int64_t t0, int tt,
                               int64_t T, int m, vf *a) {
    const vf total = vload_lanes(stats + 2 * m * T, t0, tt);
    a[0] = vexp(vload_lanes(lse, t0, tt) - total);
    for (int k = 0; k < m; ++k) a[1 + k] = vexp(vload_lanes(stats + k * T, t0, tt) - total);
}

/* y = a0 o1 + sum_k a_k e_k per token (aw [m + 1, VW]: the weights' lanes). */
INLINE void merge_tile_mix(const float *ot, const float *et, int64_t rs, int m, const float *aw,
                           int tt, int D, float *y) {
    for (int i = 0; i < tt; ++i) {
        const int64_t o = (int64_t)i * D;
        const float *x0 = ot + o;
        float *yt = y + o;
        const float a0 = aw[i];
#pragma omp simd
        for (int d = 0; d < D; ++d) yt[d] = a0 * x0[d];
        for (int k = 0; k < m; ++k) {
            const float ak = aw[(1 + k) * VW + i];
            const float *x = et + k * rs + o;
#pragma omp simd
            for (int d = 0; d < D; ++d) yt[d] += ak * x[d];
        }
    }
}

/* le_k = r_k <e_k, u>, total = logaddexp(lse, logsumexp_k le_k), y the mix; le_k and r_k to
 * stats[k T] and stats[(m + k) T], total to stats[2 m T]. */
INLINE void merge_tile_forward(const float *ot, const float *lse, const float *et, int64_t rs,
                               const float *u, int m, int64_t t0, int tt, int D, float eps,
                               float *y, float *stats, int64_t T) {
    vf r[m], le[m], a[m + 1];
    for (int k = 0; k < m; ++k) tile_logits(et + k * rs, u, tt, D, eps, r + k, le + k);
    const vf l0 = vload_lanes(lse, t0, tt);
    vf mx = l0;
    for (int k = 0; k < m; ++k) mx = vmax(mx, le[k]);
    vf s = vexp(l0 - mx);
    for (int k = 0; k < m; ++k) s += vexp(le[k] - mx);
    const vf total = mx + vlog(s);
    for (int k = 0; k < m; ++k) {
        vstore_lanes(stats + k * T, t0, tt, le[k]);
        vstore_lanes(stats + (m + k) * T, t0, tt, r[k]);
    }
    vstore_lanes(stats + 2 * m * T, t0, tt, total);
    a[0] = vexp(l0 - total);
    for (int k = 0; k < m; ++k) a[1 + k] = vexp(le[k] - total);
    float aw[(m + 1) * VW];
    for (int k = 0; k <= m; ++k) vstore(aw + k * VW, a[k]);
    merge_tile_mix(ot, et, rs, m, aw, tt, D, y);
}

/* d a0 = <g, o1>, d a_k = <g, e_k>, c = a0 d a0 + sum_k a_k d a_k; d lse = a0 (d a0 - c),
 * d le_k = a_k (d a_k - c); d o1 = a0 g; d e_k = a_k g + r_k d le_k u - r_k^2 / D d le_k le_k e_k
 * (ge's rows rs apart); du += sum_k r_k d le_k e_k. stats as merge_tile_forward wrote them. */
INLINE void merge_tile_backward(const float *ot, const float *lse, const float *et, int64_t rs,
                                const float *u, const float *stats, int64_t t0, int tt,
                                int64_t T, int m, const float *g, int D, float *go1,
                                float *glse, float *ge, int accumulate, float *du) {
    float dg[(m + 1) * VW]; /* lanes of <g, o1>, then <g, e_k> */
    for (int i = 0; i < VW; ++i) {
        const int64_t o = (int64_t)i * D;
        const float *rows[m + 1];
        float s[m + 1];
        rows[0] = ot + o;
        for (int k = 0; k < m; ++k) rows[k + 1] = et + k * rs + o;
        if (i < tt) dots(g + o, rows, m + 1, D, s);
        else for (int k = 0; k <= m; ++k) s[k] = 0.f;
        for (int k = 0; k <= m; ++k) dg[k * VW + i] = s[k];
    }
    vf a[m + 1];
    merge_tile_weights(lse, stats, t0, tt, T, m, a);
    vf c = a[0] * vload(dg);
    for (int k = 0; k < m; ++k) c += a[1 + k] * vload(dg + (1 + k) * VW);
    vstore_lanes(glse, t0, tt, a[0] * (vload(dg) - c));
    float av[(m + 1) * VW], drawv[m * VW], coefv[m * VW];
    vstore(av, a[0]);
    for (int k = 0; k < m; ++k) {
        const vf dl = a[1 + k] * (vload(dg + (1 + k) * VW) - c);
        const vf r = vload_lanes(stats + (m + k) * T, t0, tt);
        const vf le = vload_lanes(stats + k * T, t0, tt);
        vstore(av + (1 + k) * VW, a[1 + k]);
        vstore(drawv + k * VW, dl * r);
        vstore(coefv + k * VW, -(r * r / (float)D) * dl * le);
    }
    for (int i = 0; i < tt; ++i) {
        const int64_t o = (int64_t)i * D;
        const float *gt = g + o;
        if (go1) {
            float *z = go1 + o;
            const float a0 = av[i];
#pragma omp simd
            for (int d = 0; d < D; ++d) z[d] = a0 * gt[d];
        }
        for (int k = 0; k < m; ++k) {
            const float ak = av[(1 + k) * VW + i], draw = drawv[k * VW + i];
            const float coef = coefv[k * VW + i];
            const float *x = et + k * rs + o;
            if (ge) {
                float *y = ge + k * rs + o;
                if (accumulate) {
#pragma omp simd
                    for (int d = 0; d < D; ++d) y[d] += ak * gt[d] + draw * u[d] + coef * x[d];
                } else {
#pragma omp simd
                    for (int d = 0; d < D; ++d) y[d] = ak * gt[d] + draw * u[d] + coef * x[d];
                }
            }
#pragma omp simd
            for (int d = 0; d < D; ++d) du[d] += draw * x[d];
        }
    }
}

#endif
