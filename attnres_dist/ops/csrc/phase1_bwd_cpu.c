/* Phase 1's backward (see phase1_tile.h): the blocks' gradient (written, or added to a buffer
 * other readers add to) and the queries' and gains' gradients; where the forward normalised
 * the first query's output too, that norm's backward first, per tile, into a per-thread
 * buffer the tile then reads as the first query's output gradient. */
#include "norm_token.h"
#include "phase1_tile.h"

/* Phase 1's backward for tokens t0 .. t0 + tt - 1 (see phase1_backward; bt and gb at the
 * tile's first token, rows rs apart; Gs the output gradients at the tile's first token (NULL:
 * zero); logit [n, S, VW] and r [n, VW] the tile's statistics; du the thread's [PAD4(S), D];
 * copy as in the forward). */
INLINE void phase1_tile_backward(const float *bt, int64_t rs, int n, int D, int S, const int QW,
                                 const float *u, const float *const *lses, int64_t t0, int tt,
                                 const float *logit, const float *r, const float *const *Gs,
                                 const float *const *glses, float *gb, int accumulate, float *du,
                                 int any_G, float *copy, int64_t T) {
    const int SQ = (S + QW - 1) / QW * QW;
    float p[n * SQ * VW], dl[n * SQ * VW], coef[n * VW];
    /* p = exp(logit - lse) across the tile (padding queries: 0) */
    for (int l = 0; l < SQ; ++l) {
        const vf lse = vload_lanes(l < S ? lses[l] : 0, t0, tt), none = {0};
        for (int j = 0; j < n; ++j)
            vstore(p + (j * SQ + l) * VW,
                   l < S ? vexp(vload(logit + (j * S + l) * VW) - lse) : none);
    }
    /* dp_jl = <G_l, b_j> per token */
    for (int i = 0; i < VW; ++i) {
        const float *g[SQ];
        for (int l = 0; l < SQ; ++l) g[l] = l < S && Gs[l] && i < tt ? Gs[l] + i * D : 0;
        const float *x0 = bt + (int64_t)i * D;
        const int prefetch = t0 + i + PREFETCH_AHEAD < T;
        for (int j = 0; j < n; ++j) {
            if (i < tt && prefetch) {
                prefetch_row(x0 + j * rs + PREFETCH_AHEAD * D, D);
                if (gb && accumulate) prefetch_row(gb + i * D + j * rs + PREFETCH_AHEAD * D, D);
            }
            for (int l0 = 0; l0 < SQ; l0 += QW) {
                float s[4] = {0.f, 0.f, 0.f, 0.f};
                if (any_G && i < tt) {
                    const float *gl[4];
                    for (int k = 0; k < QW; ++k) gl[k] = g[l0 + k] ? g[l0 + k] : u + (l0 + k) * D;
                    dotsq(x0 + j * rs, gl, D, QW, s, 0,
                          copy && !l0 ? copy + ((int64_t)i * n + j) * D : 0);
                    for (int k = 0; k < QW; ++k) s[k] = g[l0 + k] ? s[k] : 0.f;
                }
                for (int k = 0; k < QW; ++k) dl[(j * SQ + l0 + k) * VW + i] = s[k];
            }
        }
    }
    /* dlogit = p (dp - sum_j p dp + dlse), then draw = r dlogit, across the tile */
    for (int l = 0; l < SQ; ++l) {
        const vf gls = vload_lanes(l < S ? glses[l] : 0, t0, tt);
        vf c = {0};
        for (int j = 0; j < n; ++j)
            c += vload(p + (j * SQ + l) * VW) * vload(dl + (j * SQ + l) * VW);
        const vf shift = gls - c;
        for (int j = 0; j < n; ++j) {
            float *dj = dl + (j * SQ + l) * VW;
            vstore(dj, vload(p + (j * SQ + l) * VW) * (vload(dj) + shift));
        }
    }
    for (int j = 0; j < n; ++j) {
        const vf rj = vload(r + j * VW);
        vf acc = {0};
        for (int l = 0; l < S; ++l)
            acc += vload(dl + (j * SQ + l) * VW) * vload(logit + (j * S + l) * VW);
        vstore(coef + j * VW, -(rj * rj / (float)D) * acc);
        for (int l = 0; l < SQ; ++l) {
            float *dj = dl + (j * SQ + l) * VW;
            vstore(dj, vload(dj) * rj);
        }
    }
    /* per token, QW queries at a time: y_j += p_jl G_l + draw_jl u_l; du_l += draw_jl b_j */
    float zero[D];
    memset(zero, 0, sizeof zero);
    for (int i = 0; i < tt; ++i) {
        const float *xb = copy && any_G ? copy + (int64_t)i * n * D : bt + (int64_t)i * D;
        const int64_t xs = copy && any_G ? D : rs;
        float *gt = gb ? gb + (int64_t)i * D : 0;
        const float *g[SQ];
        for (int l = 0; l < SQ; ++l) g[l] = l < S && Gs[l] ? Gs[l] + i * D : zero;
        const float *ci = coef + i;
        for (int l0 = 0; l0 < SQ; l0 += QW) {
            const float *u0 = u + (int64_t)l0 * D;
            float *du0 = du + (int64_t)l0 * D;
            const float *pl = p + l0 * VW + i, *al = dl + l0 * VW + i;
            const int first = l0 == 0;
            int d = 0;
            /* two vector chunks at a time: the scalars' broadcasts serve both */
            for (; QW > 2 && d + 2 * VW <= D; d += 2 * VW) {
                const vf none = {0};
                const int h = d + VW;
                const vf g0 = vload(g[l0] + d), g1 = vload(g[l0 + 1] + d);
                const vf g2 = vload(g[l0 + 2] + d), G2 = vload(g[l0 + 2] + h);
                const vf g3 = QW > 3 ? vload(g[l0 + 3] + d) : none;
                const vf G0 = vload(g[l0] + h), G1 = vload(g[l0 + 1] + h);
                const vf G3 = QW > 3 ? vload(g[l0 + 3] + h) : none;
                const vf w0 = vload(u0 + d), w1 = vload(u0 + D + d), w2 = vload(u0 + 2 * D + d);
                const vf w3 = QW > 3 ? vload(u0 + 3 * D + d) : none;
                const vf W0 = vload(u0 + h), W1 = vload(u0 + D + h), W2 = vload(u0 + 2 * D + h);
                const vf W3 = QW > 3 ? vload(u0 + 3 * D + h) : none;
                vf e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0}, E0 = {0}, E1 = {0}, E2 = {0}, E3 = {0};
                for (int j = 0; j < n; ++j) {
                    const vf xv = vload(xb + j * xs + d), xh = vload(xb + j * xs + h);
                    const float *pj = pl + j * SQ * VW, *aj = al + j * SQ * VW;
                    const float a0 = aj[0], a1 = aj[VW], a2 = aj[2 * VW];
                    const float a3 = QW > 3 ? aj[3 * VW] : 0.f, p3 = QW > 3 ? pj[3 * VW] : 0.f;
                    e0 += a0 * xv, E0 += a0 * xh;
                    e1 += a1 * xv, E1 += a1 * xh;
                    e2 += a2 * xv, E2 += a2 * xh;
                    if (QW > 3) e3 += a3 * xv, E3 += a3 * xh;
                    if (!gt) continue;
                    float *y = gt + j * rs + d, *yh = y + VW;
                    const float cj = first ? ci[j * VW] : 0.f;
                    const int add = !first || accumulate;
                    vf acc = (add ? vload(y) : none) + cj * xv;
                    vf ach = (add ? vload(yh) : none) + cj * xh;
                    acc += pj[0] * g0 + a0 * w0, ach += pj[0] * G0 + a0 * W0;
                    acc += pj[VW] * g1 + a1 * w1, ach += pj[VW] * G1 + a1 * W1;
                    acc += pj[2 * VW] * g2 + a2 * w2, ach += pj[2 * VW] * G2 + a2 * W2;
                    if (QW > 3) acc += p3 * g3 + a3 * w3, ach += p3 * G3 + a3 * W3;
                    vstore(y, acc), vstore(yh, ach);
                }
                float *z = du0 + d;
                vstore(z, vload(z) + e0), vstore(z + VW, vload(z + VW) + E0);
                vstore(z + D, vload(z + D) + e1), vstore(z + D + VW, vload(z + D + VW) + E1);
                z += 2 * D;
                vstore(z, vload(z) + e2), vstore(z + VW, vload(z + VW) + E2);
                if (QW > 3)
                    vstore(z + D, vload(z + D) + e3), vstore(z + D + VW, vload(z + D + VW) + E3);
            }
            for (; d + VW <= D; d += VW) {
                const vf none = {0};
                const vf g0 = vload(g[l0] + d), g1 = vload(g[l0 + 1] + d);
                const vf g2 = QW > 2 ? vload(g[l0 + 2] + d) : none;
                const vf g3 = QW > 3 ? vload(g[l0 + 3] + d) : none;
                const vf w0 = vload(u0 + d), w1 = vload(u0 + D + d);
                const vf w2 = QW > 2 ? vload(u0 + 2 * D + d) : none;
                const vf w3 = QW > 3 ? vload(u0 + 3 * D + d) : none;
                vf e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0};
                for (int j = 0; j < n; ++j) {
                    const vf xv = vload(xb + j * xs + d);
                    const float *pj = pl + j * SQ * VW, *aj = al + j * SQ * VW;
                    e0 += aj[0] * xv;
                    e1 += aj[VW] * xv;
                    if (QW > 2) e2 += aj[2 * VW] * xv;
                    if (QW > 3) e3 += aj[3 * VW] * xv;
                    if (!gt) continue;
                    float *y = gt + j * rs + d;
                    vf acc = first ? (accumulate ? vload(y) : none) + ci[j * VW] * xv : vload(y);
                    acc += pj[0] * g0 + aj[0] * w0;
                    acc += pj[VW] * g1 + aj[VW] * w1;
                    if (QW > 2) acc += pj[2 * VW] * g2 + aj[2 * VW] * w2;
                    if (QW > 3) acc += pj[3 * VW] * g3 + aj[3 * VW] * w3;
                    vstore(y, acc);
                }
                vstore(du0 + d, vload(du0 + d) + e0);
                vstore(du0 + D + d, vload(du0 + D + d) + e1);
                if (QW > 2) vstore(du0 + 2 * D + d, vload(du0 + 2 * D + d) + e2);
                if (QW > 3) vstore(du0 + 3 * D + d, vload(du0 + 3 * D + d) + e3);
            }
            for (; d < D; ++d)
                for (int j = 0; j < n; ++j) {
                    const float x = xb[j * xs + d];
                    float acc = 0.f;
                    for (int k = 0; k < QW; ++k) {
                        const float a = al[(j * SQ + k) * VW];
                        du0[k * D + d] += a * x;
                        acc += pl[(j * SQ + k) * VW] * g[l0 + k][d] + a * u0[k * D + d];
                    }
                    if (!gt) continue;
                    float *y = gt + j * rs + d;
                    const float base = first ? (accumulate ? *y : 0.f) + ci[j * VW] * x : *y;
                    *y = base + acc;
                }
        }
    }
}

/* d b_j = sum_l p_lj G_l + sum_l draw_lj u_l - r_j^2 / D (sum_l dlogit_lj logit_lj) b_j,
 * dlogit_lj = p_lj (<G_l, b_j> - sum_j' p_lj' <G_l, b_j'> + dlse_l), draw = r_j dlogit;
 * du_l = sum_{t, j} draw_lj b_j, accumulated per thread into du_part[thread] ([PAD4(S), D]).
 * accumulate: gb += d b (a gradient buffer other reads add into) instead of gb = d b.
 * norm (or NULL): the first query's output went through an RMSNorm (gain w, reciprocal RMS rn,
 * input x0 = out1[0]) and Gs[0] is the gradient of its result: G_0 is that norm's backward,
 * formed per tile, and the gain's gradient is added to gw_part[thread] ([D]). */
typedef struct {
    const float *w, *rn, *x0;
    float *gw_part;
} FirstNorm;

static int phase1_backward(const float *b, const float *u, const float *const *lses,
                           const float *logits, const float *rstd, const float *const *Gs,
                           const float *const *glses, int n, int64_t T, int D, int S,
                           float *gb, int accumulate, float *du_part, const FirstNorm *norm,
                           int threads) {
    const int64_t rs = T * D, tiles = (T + VW - 1) / VW;
    const int64_t lstride = (int64_t)n * S * VW, rstride = (int64_t)n * VW;
    int any_G = 0;
    for (int l = 0; l < S; ++l) any_G |= Gs[l] != 0;
    const int want_copy = any_G && (int64_t)VW * n * D <= TILE_COPY_FLOATS;
    const int normed = norm && Gs[0];
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int me = omp_get_thread_num();
        float *du = du_part + (int64_t)me * PAD4(S) * D;
        float *copy = want_copy ? tile_copy_alloc(n, D) : 0;
        float *g0 = normed ? malloc((size_t)VW * D * sizeof(float)) : 0;
        float *gw = normed ? norm->gw_part + (int64_t)me * D : 0;
        failed = (want_copy && !copy) || (normed && !g0);
#define PHASE1_BACKWARD_TILE(QW)                                                                \
    do {                                                                                        \
        const int64_t t0 = k * VW;                                                              \
        const int tt = TILE_TOKENS(T, k);                                                       \
        const float *Gt[S];                                                                     \
        for (int l = 0; l < S; ++l) Gt[l] = Gs[l] ? Gs[l] + t0 * D : 0;                         \
        if (normed) {                                                                           \
            for (int i = 0; i < tt; ++i)                                                        \
                norm_token_backward(norm->x0 + (t0 + i) * D, norm->w, norm->rn[t0 + i],         \
                                    Gt[0] + (int64_t)i * D, D, g0 + (int64_t)i * D, gw);        \
            Gt[0] = g0;                                                                         \
        }                                                                                       \
        phase1_tile_backward(b + t0 * D, rs, n, D, S, QW, u, lses, t0, tt, logits + k * lstride, \
                             rstd + k * rstride, Gt, glses, gb ? gb + t0 * D : 0, accumulate,  \
                             du, any_G, copy, T);                                               \
    } while (0)
        /* every thread takes part in the loop; one whose buffer is missing skips its tiles */
        if (S <= 2) {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < tiles; ++k)
                if (!normed || g0) PHASE1_BACKWARD_TILE(2);
        } else if (S == 3) {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < tiles; ++k)
                if (!normed || g0) PHASE1_BACKWARD_TILE(3);
        } else {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < tiles; ++k)
                if (!normed || g0) PHASE1_BACKWARD_TILE(4);
        }
#undef PHASE1_BACKWARD_TILE
        free(copy), free(g0);
    }
    return failed ? -1 : 0;
}

/* gqs / ggs: S pointers each, or NULL (not needed). w (or NULL): the forward normalised the
 * first query's output (x0 = out1[0], reciprocal RMS rn) and Gs[0] is the gradient of the
 * normalised rows; gw (or NULL) receives the norm gain's gradient. */
int phase1_bwd(const float *b, const float *const *qs, const float *const *gs,
               const float *const *lses, const float *logits, const float *rstd,
               const float *const *Gs, const float *const *glses, int n, int64_t T, int D, int S,
               float *gb, int accumulate, float *const *gqs, float *const *ggs, const float *w,
               const float *rn, const float *x0, float *gw, int threads) {
    BackwardWork work = {0, 0};
    float *q = gather_rows(qs, S, D), *g = gather_rows(gs, S, D);
    float *gq = gqs ? malloc((size_t)S * D * sizeof(float)) : 0;
    float *gg = ggs ? malloc((size_t)S * D * sizeof(float)) : 0;
    float *gw_part = w ? calloc((size_t)threads * D, sizeof(float)) : 0;
    FirstNorm norm = {w, rn, x0, gw_part};
    int ok = q && g && (gq || !gqs) && (gg || !ggs) && (gw_part || !w) &&
             work_alloc(&work, q, g, S, PAD4(S), D, threads);
    if (ok)
        ok = phase1_backward(b, work.u, lses, logits, rstd, Gs, glses, n, T, D, S, gb, accumulate,
                             work.du, w ? &norm : 0, threads) == 0;
    if (ok && w) sum_parts(gw_part, threads, D, gw); /* zeros where Gs[0] is NULL */
    ok = work_finish(&work, ok, threads, S, PAD4(S), D, q, g, gq, gg) == 0;
    for (int l = 0; ok && l < S; ++l) {
        if (gqs) memcpy(gqs[l], gq + (int64_t)l * D, (size_t)D * sizeof(float));
        if (ggs) memcpy(ggs[l], gg + (int64_t)l * D, (size_t)D * sizeof(float));
    }
    free(q), free(g), free(gq), free(gg), free(gw_part);
    return ok ? 0 : -1;
}
