/* Phase 1 of two-phase depth attention, forward and backward, fused per token: the S queries
 * of a segment attend over the n completed blocks of the store.
 *
 * The torch-ops path (ops/two_phase.py) reads the blocks about ten times per pass (key
 * statistics, logits, mix, and the backward's products and adds) and calls ~30 ops; here each
 * token's n block rows are read from memory once per pass and kept in L1 (a tile) while the key
 * statistics, logits, softmax, mix and gradients are formed. The forward keeps its logits and
 * key statistics for the backward, which forms p = exp(logit - lse) with the same exponential
 * (exactly 1 for one block).
 */
#include "vector_math.h"

/* Phase 1 takes its queries QW at a time: 4, or 2 when S <= 2 (the per-token functions are
 * inlined with QW a constant, so its loops unroll into registers). u has PAD4(S) rows, zero
 * after S; per-token arrays are [n, SQ] (j-major, SQ = S rounded up to a multiple of QW),
 * padded to a multiple of VW. Each query's tensors (its query and gain [D], its output and
 * output gradient [T, D], its lse and lse gradient [T]) are separate, reached through arrays
 * of S pointers: a sublayer's slice is a tensor of its own, so no [S, ...] stack is formed
 * around the kernels (a NULL gradient pointer is a zero gradient). */
#define PAD4(s) (((s) + 3) & ~3)
#define PADV(x) (((x) + VW - 1) & ~(VW - 1))

/* p[j, l] = softmax over j of p[j, l] (logits in, weights out; padding queries l >= S get 0);
 * lses[l][t] = the log-sum-exp of query l < S. */
INLINE void token_softmax(float *p, int n, int S, const int QW, float *const *lses, int64_t t) {
    const int SQ = (S + QW - 1) / QW * QW;
    float mx[SQ], inv[SQ];
    if (QW == 4) { /* four queries per vector */
        for (int l0 = 0; l0 < SQ; l0 += 4) {
            vf4 m = vload4(p + l0);
            for (int j = 1; j < n; ++j) m = vmax4(m, vload4(p + j * SQ + l0));
            for (int k = 0; k < 4; ++k) mx[l0 + k] = l0 + k < S ? m[k] : 1e4f;
        }
        for (int j = 0; j < n; ++j)
            for (int l0 = 0; l0 < SQ; l0 += 4)
                vstore4(p + j * SQ + l0, vload4(p + j * SQ + l0) - vload4(mx + l0));
    } else {
        for (int l = 0; l < SQ; ++l) {
            float m = p[l];
            for (int j = 1; j < n; ++j) m = p[j * SQ + l] > m ? p[j * SQ + l] : m;
            mx[l] = l < S ? m : 1e4f;
        }
        for (int j = 0; j < n; ++j)
            for (int l = 0; l < SQ; ++l) p[j * SQ + l] -= mx[l];
    }
    for (int i = n * SQ; i < PADV(n * SQ); ++i) p[i] = -100.f;
    exp_inplace(p, PADV(n * SQ));
    if (QW == 4) {
        for (int l0 = 0; l0 < SQ; l0 += 4) {
            vf4 s = vload4(p + l0);
            for (int j = 1; j < n; ++j) s += vload4(p + j * SQ + l0);
            vstore4(inv + l0, s);
        }
    } else {
        for (int l = 0; l < SQ; ++l) inv[l] = 0.f;
        for (int j = 0; j < n; ++j)
            for (int l = 0; l < SQ; ++l) inv[l] += p[j * SQ + l];
    }
    for (int l = 0; l < SQ; ++l) {
        if (l < S) lses[l][t] = mx[l] + logf(inv[l]);
        inv[l] = l < S ? 1.0f / inv[l] : 0.f;
    }
    if (QW == 4) {
        for (int j = 0; j < n; ++j)
            for (int l0 = 0; l0 < SQ; l0 += 4)
                vstore4(p + j * SQ + l0, vload4(p + j * SQ + l0) * vload4(inv + l0));
    } else {
        for (int j = 0; j < n; ++j)
            for (int l = 0; l < SQ; ++l) p[j * SQ + l] *= inv[l];
    }
}

/* One token t of phase 1's forward: bt its first row (rows rs apart), outs / lses the queries'
 * outputs and log-sum-exps, logit [n, S] and r [n] its saved statistics. */
INLINE void phase1_token_forward(const float *bt, int64_t rs, int n, int D, int S, const int QW,
                                 const float *u, float eps, float *const *outs,
                                 float *const *lses, int64_t t, float *logit, float *r,
                                 int prefetch, int tiled) {
    const int SQ = (S + QW - 1) / QW * QW;
    float p[PADV(n * SQ)], sq[n], tile[tiled ? n * D : 1];
    const float *xb = tiled ? tile : bt; /* rows after the first pass, xs apart */
    const int64_t xs = tiled ? D : rs;
    for (int j = 0; j < n; ++j) {
        const float *x = bt + j * rs;
        float *pj = p + j * SQ;
        if (prefetch) prefetch_row(x + PREFETCH_AHEAD * D, D);
        for (int l0 = 0; l0 < SQ; l0 += QW) {
            const float *w[4];
            for (int k = 0; k < QW; ++k) w[k] = u + (int64_t)(l0 + k) * D;
            dotsq(x, w, D, QW, pj + l0, l0 ? 0 : sq + j, tiled && !l0 ? tile + j * D : 0);
        }
    }
    /* the key statistics and scaled logits after all rows' dot products: no row waits on its
     * square root */
#pragma omp simd
    for (int j = 0; j < n; ++j) r[j] = 1.0f / sqrtf(sq[j] / (float)D + eps);
    for (int j = 0; j < n; ++j) {
        float *pj = p + j * SQ;
        for (int l = 0; l < SQ; ++l) pj[l] *= r[j];
        for (int l = 0; l < S; ++l) logit[j * S + l] = pj[l];
    }
    token_softmax(p, n, S, QW, lses, t);
    /* out_l = sum_j p_jl b_j, QW queries at a time over D in vector chunks */
    for (int l0 = 0; l0 < S; l0 += QW) {
        float *o0 = outs[l0] + t * D, *o1 = l0 + 1 < S ? outs[l0 + 1] + t * D : 0;
        float *o2 = QW > 2 && l0 + 2 < S ? outs[l0 + 2] + t * D : 0;
        float *o3 = QW > 2 && l0 + 3 < S ? outs[l0 + 3] + t * D : 0;
        int d = 0;
        /* two vector chunks at a time: eight independent sums, each over j in order */
        for (; d + 2 * VW <= D; d += 2 * VW) {
            vf c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, h0 = {0}, h1 = {0}, h2 = {0}, h3 = {0};
            for (int j = 0; j < n; ++j) {
                const vf xv = vload(xb + j * xs + d), xh = vload(xb + j * xs + d + VW);
                const float *pj = p + j * SQ + l0;
                c0 += pj[0] * xv;
                h0 += pj[0] * xh;
                c1 += pj[1] * xv;
                h1 += pj[1] * xh;
                if (QW > 2) {
                    c2 += pj[2] * xv;
                    h2 += pj[2] * xh;
                    c3 += pj[3] * xv;
                    h3 += pj[3] * xh;
                }
            }
            vstore(o0 + d, c0), vstore(o0 + d + VW, h0);
            if (o1) vstore(o1 + d, c1), vstore(o1 + d + VW, h1);
            if (o2) vstore(o2 + d, c2), vstore(o2 + d + VW, h2);
            if (o3) vstore(o3 + d, c3), vstore(o3 + d + VW, h3);
        }
        for (; d + VW <= D; d += VW) {
            vf c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int j = 0; j < n; ++j) {
                const vf xv = vload(xb + j * xs + d);
                const float *pj = p + j * SQ + l0;
                c0 += pj[0] * xv;
                c1 += pj[1] * xv;
                if (QW > 2) {
                    c2 += pj[2] * xv;
                    c3 += pj[3] * xv;
                }
            }
            vstore(o0 + d, c0);
            if (o1) vstore(o1 + d, c1);
            if (o2) vstore(o2 + d, c2);
            if (o3) vstore(o3 + d, c3);
        }
        for (; d < D; ++d)
            for (int k = 0; k < QW && l0 + k < S; ++k) {
                float c = 0.f;
                for (int j = 0; j < n; ++j) c += p[j * SQ + l0 + k] * xb[j * xs + d];
                outs[l0 + k][t * D + d] = c;
            }
    }
}

/* Writes out1, lse and, for the backward, the key statistics r [T, n] and logits [T, n, S]. */
static void phase1_forward(const float *b, const float *u, int n, int64_t T, int D, int S,
                           float eps, float *const *outs, float *const *lses, float *logits,
                           float *rstd, int threads) {
    const int64_t rs = T * D;
    const int tiled = (int64_t)n * D <= TILE_FLOATS;
#define PHASE1_FORWARD_TOKEN(QW)                                                                \
    phase1_token_forward(b + t * D, rs, n, D, S, QW, u, eps, outs, lses, t, logits + t * n * S,    \
                         rstd + t * n, t + PREFETCH_AHEAD < T, tiled)
    if (S <= 2) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < T; ++t) PHASE1_FORWARD_TOKEN(2);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < T; ++t) PHASE1_FORWARD_TOKEN(4);
    }
#undef PHASE1_FORWARD_TOKEN
}

/* One token t of phase 1's backward (see phase1_backward; gb already at this token, its rows
 * rs apart; lses, Gs, glses the queries' saved log-sum-exps and gradients; du the thread's
 * [PAD4(S), D]). */
INLINE void phase1_token_backward(const float *bt, int64_t rs, int n, int D, int S, const int QW,
                                  const float *u, const float *const *lses, int64_t t,
                                  const float *logit, const float *r, const float *const *Gs,
                                  const float *const *glses, float *gb, int accumulate, float *du,
                                  const float *zero, int prefetch, int tiled) {
    const int SQ = (S + QW - 1) / QW * QW;
    float p[PADV(n * SQ)], dl[n * SQ], coef[n], gls[SQ], tile[tiled ? n * D : 1];
    const float *g[SQ];
    const float *xb = tiled ? tile : bt; /* rows after the first pass, xs apart */
    const int64_t xs = tiled ? D : rs;
    int has_G = 0;
    for (int l = 0; l < SQ; ++l) {
        g[l] = l < S && Gs[l] ? Gs[l] + t * D : zero;
        has_G |= g[l] != zero;
    }
    for (int j = 0; j < n; ++j)
        for (int l = 0; l < SQ; ++l) p[j * SQ + l] = l < S ? logit[j * S + l] - lses[l][t] : -100.f;
    for (int i = n * SQ; i < PADV(n * SQ); ++i) p[i] = -100.f;
    exp_inplace(p, PADV(n * SQ));
    for (int j = 0; j < n; ++j) {
        if (prefetch) {
            prefetch_row(bt + j * rs + PREFETCH_AHEAD * D, D);
            if (gb && accumulate) prefetch_row(gb + j * rs + PREFETCH_AHEAD * D, D);
        }
        for (int l0 = 0; l0 < SQ; l0 += QW) {
            if (has_G)
                dotsq(bt + j * rs, g + l0, D, QW, dl + j * SQ + l0, 0,
                      tiled && !l0 ? tile + j * D : 0);
            else
                for (int k = 0; k < QW; ++k) dl[j * SQ + l0 + k] = 0.f;
        }
    }
    /* dlogit = p (dp - sum_j p dp + dlse) (padding queries: p = 0) */
    for (int l = 0; l < SQ; ++l) gls[l] = l < S && glses[l] ? glses[l][t] : 0.f;
    if (QW == 4) { /* four queries per vector */
        for (int l0 = 0; l0 < SQ; l0 += 4) {
            vf4 c = {0};
            for (int j = 0; j < n; ++j) c += vload4(p + j * SQ + l0) * vload4(dl + j * SQ + l0);
            const vf4 shift = vload4(gls + l0) - c;
            for (int j = 0; j < n; ++j) {
                float *dj = dl + j * SQ + l0;
                vstore4(dj, vload4(p + j * SQ + l0) * (vload4(dj) + shift));
            }
        }
    } else {
        for (int l = 0; l < SQ; ++l) {
            float c = 0.f;
            for (int j = 0; j < n; ++j) c += p[j * SQ + l] * dl[j * SQ + l];
            const float shift = gls[l] - c;
            for (int j = 0; j < n; ++j) dl[j * SQ + l] = p[j * SQ + l] * (dl[j * SQ + l] + shift);
        }
    }
    for (int j = 0; j < n; ++j) {
        float acc = 0.f;
        for (int l = 0; l < S; ++l) acc += dl[j * SQ + l] * logit[j * S + l];
        coef[j] = -(r[j] * r[j] / (float)D) * acc;
        for (int l = 0; l < SQ; ++l) dl[j * SQ + l] *= r[j]; /* dl is draw = r dlogit from here */
    }
    /* QW queries at a time: y_j += p_jl G_l + draw_jl u_l; du_l += draw_jl b_j */
    for (int l0 = 0; l0 < SQ; l0 += QW) {
        const float *u0 = u + (int64_t)l0 * D;
        float *du0 = du + (int64_t)l0 * D;
        const int first = l0 == 0;
        int d = 0;
        /* two vector chunks at a time: the scalars' broadcasts serve both (four queries: with
         * two, GCC contracts the adds into y differently from the one-chunk loop below) */
        for (; QW > 2 && d + 2 * VW <= D; d += 2 * VW) {
            const vf none = {0};
            const int h = d + VW;
            const vf g0 = vload(g[l0] + d), g1 = vload(g[l0 + 1] + d);
            const vf g2 = vload(g[l0 + 2] + d), g3 = vload(g[l0 + 3] + d);
            const vf G0 = vload(g[l0] + h), G1 = vload(g[l0 + 1] + h);
            const vf G2 = vload(g[l0 + 2] + h), G3 = vload(g[l0 + 3] + h);
            const vf w0 = vload(u0 + d), w1 = vload(u0 + D + d);
            const vf w2 = vload(u0 + 2 * D + d), w3 = vload(u0 + 3 * D + d);
            const vf W0 = vload(u0 + h), W1 = vload(u0 + D + h);
            const vf W2 = vload(u0 + 2 * D + h), W3 = vload(u0 + 3 * D + h);
            vf e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0}, E0 = {0}, E1 = {0}, E2 = {0}, E3 = {0};
            for (int j = 0; j < n; ++j) {
                const vf xv = vload(xb + j * xs + d), xh = vload(xb + j * xs + h);
                const float *pj = p + j * SQ + l0, *aj = dl + j * SQ + l0;
                e0 += aj[0] * xv, E0 += aj[0] * xh;
                e1 += aj[1] * xv, E1 += aj[1] * xh;
                e2 += aj[2] * xv, E2 += aj[2] * xh;
                e3 += aj[3] * xv, E3 += aj[3] * xh;
                if (!gb) continue;
                float *y = gb + j * rs + d, *yh = y + VW;
                const float cj = first ? coef[j] : 0.f;
                const int add = !first || accumulate;
                vf acc = (add ? vload(y) : none) + cj * xv;
                vf ach = (add ? vload(yh) : none) + cj * xh;
                acc += pj[0] * g0 + aj[0] * w0, ach += pj[0] * G0 + aj[0] * W0;
                acc += pj[1] * g1 + aj[1] * w1, ach += pj[1] * G1 + aj[1] * W1;
                acc += pj[2] * g2 + aj[2] * w2, ach += pj[2] * G2 + aj[2] * W2;
                acc += pj[3] * g3 + aj[3] * w3, ach += pj[3] * G3 + aj[3] * W3;
                vstore(y, acc), vstore(yh, ach);
            }
            float *z = du0 + d;
            vstore(z, vload(z) + e0), vstore(z + VW, vload(z + VW) + E0);
            vstore(z + D, vload(z + D) + e1), vstore(z + D + VW, vload(z + D + VW) + E1);
            z += 2 * D;
            vstore(z, vload(z) + e2), vstore(z + VW, vload(z + VW) + E2);
            vstore(z + D, vload(z + D) + e3), vstore(z + D + VW, vload(z + D + VW) + E3);
        }
        for (; d + VW <= D; d += VW) {
            const vf none = {0};
            const vf g0 = vload(g[l0] + d), g1 = vload(g[l0 + 1] + d);
            const vf g2 = QW > 2 ? vload(g[l0 + 2] + d) : none;
            const vf g3 = QW > 2 ? vload(g[l0 + 3] + d) : none;
            const vf w0 = vload(u0 + d), w1 = vload(u0 + D + d);
            const vf w2 = QW > 2 ? vload(u0 + 2 * D + d) : none;
            const vf w3 = QW > 2 ? vload(u0 + 3 * D + d) : none;
            vf e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0};
            for (int j = 0; j < n; ++j) {
                const vf xv = vload(xb + j * xs + d);
                const float *pj = p + j * SQ + l0, *aj = dl + j * SQ + l0;
                e0 += aj[0] * xv;
                e1 += aj[1] * xv;
                if (QW > 2) {
                    e2 += aj[2] * xv;
                    e3 += aj[3] * xv;
                }
                if (!gb) continue;
                float *y = gb + j * rs + d;
                vf acc = first ? (accumulate ? vload(y) : none) + coef[j] * xv : vload(y);
                acc += pj[0] * g0 + aj[0] * w0;
                acc += pj[1] * g1 + aj[1] * w1;
                if (QW > 2) {
                    acc += pj[2] * g2 + aj[2] * w2;
                    acc += pj[3] * g3 + aj[3] * w3;
                }
                vstore(y, acc);
            }
            vstore(du0 + d, vload(du0 + d) + e0);
            vstore(du0 + D + d, vload(du0 + D + d) + e1);
            if (QW > 2) {
                vstore(du0 + 2 * D + d, vload(du0 + 2 * D + d) + e2);
                vstore(du0 + 3 * D + d, vload(du0 + 3 * D + d) + e3);
            }
        }
        for (; d < D; ++d)
            for (int j = 0; j < n; ++j) {
                const float x = xb[j * xs + d];
                float acc = 0.f;
                for (int k = 0; k < QW; ++k) {
                    const float a = dl[j * SQ + l0 + k];
                    du0[k * D + d] += a * x;
                    acc += p[j * SQ + l0 + k] * g[l0 + k][d] + a * u0[k * D + d];
                }
                if (!gb) continue;
                float *y = gb + j * rs + d;
                const float base = first ? (accumulate ? *y : 0.f) + coef[j] * x : *y;
                *y = base + acc;
            }
    }
}

/* d b_j = sum_l p_lj G_l + sum_l draw_lj u_l - r_j^2 / D (sum_l dlogit_lj logit_lj) b_j,
 * dlogit_lj = p_lj (<G_l, b_j> - sum_j' p_lj' <G_l, b_j'> + dlse_l), draw = r_j dlogit;
 * du_l = sum_{t, j} draw_lj b_j, accumulated per thread into du_part[thread] ([PAD4(S), D]).
 * accumulate: gb += d b (a gradient buffer other reads add into) instead of gb = d b. */
static void phase1_backward(const float *b, const float *u, const float *const *lses,
                            const float *logits, const float *rstd, const float *const *Gs,
                            const float *const *glses, int n, int64_t T, int D, int S,
                            float *gb, int accumulate, float *du_part, int threads) {
    const int64_t rs = T * D;
    int any_G = 0;
    for (int l = 0; l < S; ++l) any_G |= Gs[l] != 0;
    const int tiled = any_G && (int64_t)n * D <= TILE_FLOATS;
#pragma omp parallel num_threads(threads)
    {
        float *du = du_part + (int64_t)omp_get_thread_num() * PAD4(S) * D;
        float zero[D];
        memset(zero, 0, sizeof zero);
#define PHASE1_BACKWARD_TOKEN(QW)                                                               \
    phase1_token_backward(b + t * D, rs, n, D, S, QW, u, lses, t, logits + t * n * S,           \
                          rstd + t * n, Gs, glses, gb ? gb + t * D : 0, accumulate, du, zero,   \
                          t + PREFETCH_AHEAD < T, tiled)
        if (S <= 2) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) PHASE1_BACKWARD_TOKEN(2);
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) PHASE1_BACKWARD_TOKEN(4);
        }
#undef PHASE1_BACKWARD_TOKEN
    }
}

/* The S rows [D] of qs as one [S, D] array (NULL when out of memory). */
static float *gather_rows(const float *const *qs, int S, int D) {
    float *x = malloc((size_t)S * D * sizeof(float));
    for (int l = 0; x && l < S; ++l) memcpy(x + (int64_t)l * D, qs[l], (size_t)D * sizeof(float));
    return x;
}

/* The entry points take each query's tensors through arrays of S pointers (see the top).
 * Returns 0, or -1 when the small work buffers cannot be allocated. */
int phase1_fwd(const float *b, const float *const *qs, const float *const *gs, int n, int64_t T,
               int D, int S, float eps, float *const *outs, float *const *lses, float *logits,
               float *rstd, int threads) {
    float *q = gather_rows(qs, S, D), *g = gather_rows(gs, S, D);
    float *u = q && g ? products(q, g, S, PAD4(S), D) : 0;
    if (u) phase1_forward(b, u, n, T, D, S, eps, outs, lses, logits, rstd, threads);
    free(q), free(g), free(u);
    return u ? 0 : -1;
}

/* gqs / ggs: S pointers each, or NULL (not needed). */
int phase1_bwd(const float *b, const float *const *qs, const float *const *gs,
               const float *const *lses, const float *logits, const float *rstd,
               const float *const *Gs, const float *const *glses, int n, int64_t T, int D, int S,
               float *gb, int accumulate, float *const *gqs, float *const *ggs, int threads) {
    BackwardWork w = {0, 0};
    float *q = gather_rows(qs, S, D), *g = gather_rows(gs, S, D);
    float *gq = gqs ? malloc((size_t)S * D * sizeof(float)) : 0;
    float *gg = ggs ? malloc((size_t)S * D * sizeof(float)) : 0;
    int ok = q && g && (gq || !gqs) && (gg || !ggs) && work_alloc(&w, q, g, S, PAD4(S), D, threads);
    if (ok)
        phase1_backward(b, w.u, lses, logits, rstd, Gs, glses, n, T, D, S, gb, accumulate, w.du,
                        threads);
    ok = work_finish(&w, ok, threads, S, PAD4(S), D, q, g, gq, gg) == 0;
    for (int l = 0; ok && l < S; ++l) {
        if (gqs) memcpy(gqs[l], gq + (int64_t)l * D, (size_t)D * sizeof(float));
        if (ggs) memcpy(ggs[l], gg + (int64_t)l * D, (size_t)D * sizeof(float));
    }
    free(q), free(g), free(gq), free(gg);
    return ok ? 0 : -1;
}
