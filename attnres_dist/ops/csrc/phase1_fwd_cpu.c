/* Phase 1's forward (see phase1_tile.h): out1 and lse per query, and the tiles' logits and
 * key statistics the backward reads; optionally the first query's out1 normalised by the
 * sublayer's RMSNorm as well (norm_token.h, the standalone kernel's arithmetic), while the
 * tile's rows are still in L1. */
#include "norm_token.h"
#include "phase1_tile.h"

/* Phase 1's forward for tokens t0 .. t0 + tt - 1: bt the tile's first token's first row (rows
 * rs apart), logit [n, S, VW] and r [n, VW] the tile's saved statistics, copy a [VW, n, D]
 * buffer or NULL. */
INLINE void phase1_tile_forward(const float *bt, int64_t rs, int n, int D, int S, const int QW,
                                const float *u, float eps, float *const *outs,
                                float *const *lses, int64_t t0, int tt, float *logit, float *r,
                                float *copy, int64_t T) {
    const int SQ = (S + QW - 1) / QW * QW;
    float p[n * SQ * VW], sq[n * VW];
    const float *w[SQ];
    for (int l = 0; l < SQ; ++l) w[l] = u + (int64_t)l * D;
    for (int i = 0; i < VW; ++i) {
        if (i >= tt) { /* lanes past the last token: zero logits, unit key statistics */
            for (int j = 0; j < n; ++j) {
                sq[j * VW + i] = (float)D;
                for (int l = 0; l < SQ; ++l) p[(j * SQ + l) * VW + i] = 0.f;
            }
            continue;
        }
        const float *x0 = bt + (int64_t)i * D;
        const int prefetch = t0 + i + PREFETCH_AHEAD < T;
        for (int j = 0; j < n; ++j) {
            const float *x = x0 + j * rs;
            if (prefetch) prefetch_row(x + PREFETCH_AHEAD * D, D);
            for (int l0 = 0; l0 < SQ; l0 += QW) {
                float s[4];
                dotsq(x, w + l0, D, QW, s, l0 ? 0 : sq + j * VW + i,
                      copy && !l0 ? copy + ((int64_t)i * n + j) * D : 0);
                for (int k = 0; k < QW; ++k) p[(j * SQ + l0 + k) * VW + i] = s[k];
            }
        }
    }
    /* across the tile: key statistics, scaled logits, softmax over j, log-sum-exp */
    for (int j = 0; j < n; ++j) vstore(r + j * VW, vrsqrt_mean(vload(sq + j * VW), D, eps));
    for (int l = 0; l < S; ++l) {
        vf m = {0};
        for (int j = 0; j < n; ++j) {
            float *pj = p + (j * SQ + l) * VW;
            const vf z = vload(pj) * vload(r + j * VW);
            vstore(pj, z);
            vstore(logit + (j * S + l) * VW, z);
            m = j ? vmax(m, z) : z;
        }
        vf sum = {0};
        for (int j = 0; j < n; ++j) {
            float *pj = p + (j * SQ + l) * VW;
            const vf e = vexp(vload(pj) - m);
            vstore(pj, e);
            sum += e;
        }
        vstore_lanes(lses[l], t0, tt, m + vlog(sum));
        const vf inv = 1.0f / sum;
        for (int j = 0; j < n; ++j) {
            float *pj = p + (j * SQ + l) * VW;
            vstore(pj, vload(pj) * inv);
        }
    }
    /* out_l = sum_j p_jl b_j per token, QW queries at a time over D in vector chunks */
    for (int i = 0; i < tt; ++i) {
        const int64_t t = t0 + i;
        const float *xb = copy ? copy + (int64_t)i * n * D : bt + (int64_t)i * D;
        const int64_t xs = copy ? D : rs;
        for (int l0 = 0; l0 < S; l0 += QW) {
            float *o0 = outs[l0] + t * D, *o1 = l0 + 1 < S ? outs[l0 + 1] + t * D : 0;
            float *o2 = QW > 2 && l0 + 2 < S ? outs[l0 + 2] + t * D : 0;
            float *o3 = QW > 3 && l0 + 3 < S ? outs[l0 + 3] + t * D : 0;
            const float *pl = p + l0 * VW + i; /* query l0 + k of row j at pl[(j SQ + k) VW] */
            int d = 0;
            /* two vector chunks at a time: eight independent sums, each over j in order */
            for (; d + 2 * VW <= D; d += 2 * VW) {
                vf c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, h0 = {0}, h1 = {0}, h2 = {0}, h3 = {0};
                for (int j = 0; j < n; ++j) {
                    const vf xv = vload(xb + j * xs + d), xh = vload(xb + j * xs + d + VW);
                    const float *pj = pl + j * SQ * VW;
                    c0 += pj[0] * xv;
                    h0 += pj[0] * xh;
                    c1 += pj[VW] * xv;
                    h1 += pj[VW] * xh;
                    if (QW > 2) {
                        c2 += pj[2 * VW] * xv;
                        h2 += pj[2 * VW] * xh;
                    }
                    if (QW > 3) {
                        c3 += pj[3 * VW] * xv;
                        h3 += pj[3 * VW] * xh;
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
                    const float *pj = pl + j * SQ * VW;
                    c0 += pj[0] * xv;
                    c1 += pj[VW] * xv;
                    if (QW > 2) c2 += pj[2 * VW] * xv;
                    if (QW > 3) c3 += pj[3 * VW] * xv;
                }
                vstore(o0 + d, c0);
                if (o1) vstore(o1 + d, c1);
                if (o2) vstore(o2 + d, c2);
                if (o3) vstore(o3 + d, c3);
            }
            for (; d < D; ++d)
                for (int k = 0; k < QW && l0 + k < S; ++k) {
                    float c = 0.f;
                    for (int j = 0; j < n; ++j) c += pl[(j * SQ + k) * VW] * xb[j * xs + d];
                    outs[l0 + k][t * D + d] = c;
                }
        }
    }
}

/* Writes out1, lse and, for the backward, the tiles' logits and key statistics; with w (the
 * first query's sublayer RMSNorm gain, or NULL) also y = norm(out1[0]) and rn ([T]), the
 * norm's reciprocal RMS. */
static int phase1_forward(const float *b, const float *u, int n, int64_t T, int D, int S,
                          float eps, float *const *outs, float *const *lses, float *logits,
                          float *rstd, const float *w, float norm_eps, float *y, float *rn,
                          int threads) {
    const int64_t rs = T * D, tiles = (T + VW - 1) / VW;
    const int64_t lstride = (int64_t)n * S * VW, rstride = (int64_t)n * VW;
    const int want_copy = (int64_t)VW * n * D <= TILE_COPY_FLOATS;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *copy = want_copy ? tile_copy_alloc(n, D) : 0;
        failed = want_copy && !copy;
#define PHASE1_FORWARD_TILE(QW)                                                                 \
    do {                                                                                        \
        const int tt = TILE_TOKENS(T, k);                                                       \
        phase1_tile_forward(b + k * VW * D, rs, n, D, S, QW, u, eps, outs, lses, k * VW, tt,    \
                            logits + k * lstride, rstd + k * rstride, copy, T);                 \
        for (int64_t t = k * VW; w && t < k * VW + tt; ++t)                                     \
            rn[t] = norm_token_forward(outs[0] + t * D, w, D, norm_eps, y + t * D);             \
    } while (0)
        if (S <= 2) {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < tiles; ++k) PHASE1_FORWARD_TILE(2);
        } else if (S == 3) {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < tiles; ++k) PHASE1_FORWARD_TILE(3);
        } else {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < tiles; ++k) PHASE1_FORWARD_TILE(4);
        }
#undef PHASE1_FORWARD_TILE
        free(copy);
    }
    return failed ? -1 : 0;
}

/* The tile width (tokens per tile, VW): the saved logits and key statistics are [ceil(T / VW),
 * n, S, VW] and [ceil(T / VW), n, VW] floats. */
int phase1_lanes(void) { return VW; }

/* The entry points take each query's tensors through arrays of S pointers (see the top).
 * Returns 0, or -1 when the small work buffers cannot be allocated. */
int phase1_fwd(const float *b, const float *const *qs, const float *const *gs, int n, int64_t T,
               int D, int S, float eps, float *const *outs, float *const *lses, float *logits,
               float *rstd, const float *w, float norm_eps, float *y, float *rn, int threads) {
    float *q = gather_rows(qs, S, D), *g = gather_rows(gs, S, D);
    float *u = q && g ? products(q, g, S, PAD4(S), D) : 0;
    const int rc =
        u ? phase1_forward(b, u, n, T, D, S, eps, outs, lses, logits, rstd, w, norm_eps, y, rn,
                           threads)
          : -1;
    free(q), free(g), free(u);
    return rc;
}

