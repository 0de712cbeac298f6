/* Two-phase depth attention (phase 1; phase 2 for one extra source, the Block partial, and for
 * several, Full AttnRes's group outputs), forward and backward, fused per token for float32 on
 * the CPU.
 *
 * The torch-ops path (ops/two_phase.py) reads the blocks about ten times per phase-1 pass
 * (key statistics, logits, mix, and the backward's products and adds) and calls ~30 ops; here
 * each token's n block rows are read from memory once per pass and stay in L1 while the key
 * statistics, logits, softmax, mix and gradients are formed. Tokens are split over OpenMP
 * threads (torch's own libgomp, already loaded under the same soname).
 *
 * Layouts (all contiguous): blocks [n, T, D], u = gains * queries ([S4, D] in phase 1: S rounded
 * up to a multiple of four, zero rows after S; [D] in phase 2), out1 / G [S, T, D],
 * lse / grad lse [S, T], extra sources e [m, T, D], out1 slice / grad [T, D]. Accumulation
 * is float32, as in the torch-ops path. Phase 1 keeps its logits for the backward, which forms
 * p = exp(logit - lse) with the forward's exponential (exactly 1 for one block).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Eight-float vectors (GCC / clang vector extensions: AVX2 / AVX-512VL registers on x86, two
 * NEON registers on arm64), loaded and stored unaligned. Every sum is formed in a fixed order,
 * so no fast-math flag is needed and a token's result does not depend on the thread count. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define VW 8

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline float vsum(vf v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

static inline float dot(const float *a, const float *b, int D) {
    vf acc = {0};
    int d = 0;
    for (; d + VW <= D; d += VW) acc += vload(a + d) * vload(b + d);
    float s = vsum(acc);
    for (; d < D; ++d) s += a[d] * b[d];
    return s;
}

/* exp of eight floats (Cephes' expf): x = k ln2 + r, |r| <= ln2 / 2, exp r = 1 + r + r^2 P(r)
 * with P of degree 5 (~1 ulp), times 2^k. x below -87.3 gives 0: the inputs here are softmax
 * logits minus their maximum (or log-sum-exp), so <= 0 up to rounding. */
static inline vf vexp(vf x) {
    const vf zero = {0};
    const vf lo = zero - 87.3f, shifter = zero + 12582912.0f; /* 1.5 * 2^23 rounds to integers */
    const vi small = x < lo;
    x = (vf)(((vi)x & ~small) | ((vi)lo & small));
    const vf t = x * 1.44269504f + shifter;
    const vf k = t - shifter;
    const vi ki = (vi)t - (vi)shifter;
    const vf r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
    vf y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = (y * r) * r + r + 1.0f;
    const vf scaled = (vf)((vi)y + (ki << 23));
    return (vf)((vi)scaled & ~small);
}

/* A token's n rows lie T * D floats apart: n streams, more than the hardware prefetchers
 * follow once n passes ~16, so each pass asks for the rows of the token PREFETCH_AHEAD ahead. */
#define PREFETCH_AHEAD 4

static inline void prefetch_row(const float *x, int D) {
    for (int d = 0; d < D; d += 16) __builtin_prefetch(x + d, 0, 3);
}

/* In place exp of len floats (len a multiple of VW). */
static void exp_inplace(float *x, int len) {
    for (int i = 0; i < len; i += VW) vstore(x + i, vexp(vload(x + i)));
}

#define INLINE static inline __attribute__((always_inline))

/* out[k] = <x, w[k]> for QW (2 or 4, a constant where inlined) rows w[k]; *sq = <x, x> and
 * copy[d] = x[d] when they are not NULL. The accumulators are named, not an array, so they stay
 * in registers. */
INLINE void dotsq(const float *restrict x, const float *const *w, int D, const int QW,
                  float *restrict out, float *restrict sq, float *restrict copy) {
    const float *restrict w0 = w[0], *restrict w1 = w[1];
    const float *restrict w2 = QW > 2 ? w[2] : w[0], *restrict w3 = QW > 2 ? w[3] : w[0];
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, aq = {0};
    int d = 0;
    for (; d + VW <= D; d += VW) {
        const vf xv = vload(x + d);
        if (copy) vstore(copy + d, xv);
        aq += xv * xv;
        a0 += xv * vload(w0 + d);
        a1 += xv * vload(w1 + d);
        if (QW > 2) {
            a2 += xv * vload(w2 + d);
            a3 += xv * vload(w3 + d);
        }
    }
    float s0 = vsum(a0), s1 = vsum(a1), s2 = vsum(a2), s3 = vsum(a3), q = vsum(aq);
    for (; d < D; ++d) {
        if (copy) copy[d] = x[d];
        q += x[d] * x[d];
        s0 += x[d] * w0[d];
        s1 += x[d] * w1[d];
        if (QW > 2) {
            s2 += x[d] * w2[d];
            s3 += x[d] * w3[d];
        }
    }
    out[0] = s0, out[1] = s1;
    if (QW > 2) out[2] = s2, out[3] = s3;
    if (sq) *sq = q;
}

/* Four-float vectors for per-token softmax bookkeeping over [n, S4] arrays (a row's queries
 * in groups of four), and their elementwise maximum. */
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));

static inline vf4 vload4(const float *p) {
    vf4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore4(float *p, vf4 v) { memcpy(p, &v, sizeof v); }

static inline vf4 vmax4(vf4 a, vf4 b) {
    const vi4 gt = a > b;
    return (vf4)(((vi4)a & gt) | ((vi4)b & ~gt));
}

/* A token's n rows lie T * D floats apart, the same address modulo 4 KiB: past the cache's
 * associativity (~12 rows) they evict each other between a token's passes. The first pass
 * copies them into a contiguous tile (when n D floats fit TILE_FLOATS) that the others read. */
#define TILE_FLOATS 16384

/* r[j] = rsqrt(mean(b_j^2) + eps) and logit[j * S + l] = r[j] <b_j, u_l> for one token. */
static void token_logits(const float *b, int64_t row_stride, int n, int D, const float *u,
                         int S, float eps, float *r, float *logit) {
    for (int j = 0; j < n; ++j) {
        const float *x = b + j * row_stride;
        const float rj = 1.0f / sqrtf(dot(x, x, D) / (float)D + eps);
        r[j] = rj;
        for (int l = 0; l < S; ++l) logit[j * S + l] = rj * dot(x, u + (int64_t)l * D, D);
    }
}

/* Phase 1 takes its queries QW at a time: 4, or 2 when S <= 2 (the per-token functions are
 * inlined with QW a constant, so its loops unroll into registers). u has PAD4(S) rows, zero
 * after S; per-token arrays are [n, SQ] (j-major, SQ = S rounded up to a multiple of QW),
 * padded to a multiple of VW. */
#define PAD4(s) (((s) + 3) & ~3)
#define PADV(x) (((x) + VW - 1) & ~(VW - 1))

/* p[j, l] = softmax over j of p[j, l] (logits in, weights out; padding queries l >= S get 0);
 * lse[l * lss] = the log-sum-exp of query l < S. */
INLINE void token_softmax(float *p, int n, int S, const int QW, float *lse, int64_t lss) {
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
    for (int l = 0; l < SQ; ++l) inv[l] = 0.f;
    for (int j = 0; j < n; ++j)
        for (int l = 0; l < SQ; ++l) inv[l] += p[j * SQ + l];
    for (int l = 0; l < SQ; ++l) {
        if (l < S) lse[l * lss] = mx[l] + logf(inv[l]);
        inv[l] = l < S ? 1.0f / inv[l] : 0.f;
    }
    for (int j = 0; j < n; ++j)
        for (int l = 0; l < SQ; ++l) p[j * SQ + l] *= inv[l];
}

/* One token of phase 1's forward: bt its first row (rows rs apart), out its first output row
 * (queries os apart), lse / lss likewise, logit [n, S] and r [n] its saved statistics. */
INLINE void phase1_token_forward(const float *bt, int64_t rs, int n, int D, int S, const int QW,
                                 const float *u, float eps, float *out, int64_t os, float *lse,
                                 int64_t lss, float *logit, float *r, int prefetch, int tiled) {
    const int SQ = (S + QW - 1) / QW * QW;
    float p[PADV(n * SQ)], sq = 0.f, tile[tiled ? n * D : 1];
    const float *xb = tiled ? tile : bt; /* rows after the first pass, xs apart */
    const int64_t xs = tiled ? D : rs;
    for (int j = 0; j < n; ++j) {
        const float *x = bt + j * rs;
        float *pj = p + j * SQ;
        if (prefetch) prefetch_row(x + PREFETCH_AHEAD * D, D);
        for (int l0 = 0; l0 < SQ; l0 += QW) {
            const float *w[4];
            for (int k = 0; k < QW; ++k) w[k] = u + (int64_t)(l0 + k) * D;
            dotsq(x, w, D, QW, pj + l0, l0 ? 0 : &sq, tiled && !l0 ? tile + j * D : 0);
        }
        const float rj = 1.0f / sqrtf(sq / (float)D + eps);
        r[j] = rj;
        for (int l = 0; l < SQ; ++l) pj[l] *= rj;
        for (int l = 0; l < S; ++l) logit[j * S + l] = pj[l];
    }
    token_softmax(p, n, S, QW, lse, lss);
    /* out_l = sum_j p_jl b_j, QW queries at a time over D in vector chunks */
    for (int l0 = 0; l0 < S; l0 += QW) {
        float *o0 = out + l0 * os;
        int d = 0;
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
            if (l0 + 1 < S) vstore(o0 + os + d, c1);
            if (QW > 2 && l0 + 2 < S) vstore(o0 + 2 * os + d, c2);
            if (QW > 2 && l0 + 3 < S) vstore(o0 + 3 * os + d, c3);
        }
        for (; d < D; ++d)
            for (int k = 0; k < QW && l0 + k < S; ++k) {
                float c = 0.f;
                for (int j = 0; j < n; ++j) c += p[j * SQ + l0 + k] * xb[j * xs + d];
                o0[k * os + d] = c;
            }
    }
}

/* Writes out1, lse and, for the backward, the key statistics r [T, n] and logits [T, n, S]. */
static void phase1_forward(const float *b, const float *u, int n, int64_t T, int D, int S,
                           float eps, float *out1, float *lse, float *logits, float *rstd,
                           int threads) {
    const int64_t rs = T * D;
    const int tiled = (int64_t)n * D <= TILE_FLOATS;
#define PHASE1_FORWARD_TOKEN(QW)                                                                \
    phase1_token_forward(b + t * D, rs, n, D, S, QW, u, eps, out1 + t * D, rs, lse + t, T,        \
                         logits + t * n * S, rstd + t * n, t + PREFETCH_AHEAD < T, tiled)
    if (S <= 2) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < T; ++t) PHASE1_FORWARD_TOKEN(2);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < T; ++t) PHASE1_FORWARD_TOKEN(4);
    }
#undef PHASE1_FORWARD_TOKEN
}

/* One token of phase 1's backward (see phase1_backward; G, glse, gb already at this token:
 * G's and lse's queries os / lss apart, gb's rows rs apart; du the thread's [PAD4(S), D]). */
INLINE void phase1_token_backward(const float *bt, int64_t rs, int n, int D, int S, const int QW,
                                  const float *u, const float *lse, int64_t lss,
                                  const float *logit, const float *r, const float *G, int64_t os,
                                  const float *glse, float *gb, int accumulate, float *du,
                                  const float *zero, int prefetch, int tiled) {
    const int SQ = (S + QW - 1) / QW * QW;
    float p[PADV(n * SQ)], dl[n * SQ], coef[n], gls[SQ], tile[tiled ? n * D : 1];
    const float *g[SQ];
    const float *xb = tiled ? tile : bt; /* rows after the first pass, xs apart */
    const int64_t xs = tiled ? D : rs;
    for (int l = 0; l < SQ; ++l) g[l] = G && l < S ? G + l * os : zero;
    for (int j = 0; j < n; ++j)
        for (int l = 0; l < SQ; ++l) p[j * SQ + l] = l < S ? logit[j * S + l] - lse[l * lss] : -100.f;
    for (int i = n * SQ; i < PADV(n * SQ); ++i) p[i] = -100.f;
    exp_inplace(p, PADV(n * SQ));
    for (int j = 0; j < n; ++j) {
        if (prefetch) {
            prefetch_row(bt + j * rs + PREFETCH_AHEAD * D, D);
            if (gb && accumulate) prefetch_row(gb + j * rs + PREFETCH_AHEAD * D, D);
        }
        for (int l0 = 0; l0 < SQ; l0 += QW) {
            if (G)
                dotsq(bt + j * rs, g + l0, D, QW, dl + j * SQ + l0, 0,
                      tiled && !l0 ? tile + j * D : 0);
            else
                for (int k = 0; k < QW; ++k) dl[j * SQ + l0 + k] = 0.f;
        }
    }
    /* dlogit = p (dp - sum_j p dp + dlse) (padding queries: p = 0) */
    for (int l = 0; l < SQ; ++l) gls[l] = glse && l < S ? glse[l * lss] : 0.f;
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
static void phase1_backward(const float *b, const float *u, const float *lse, const float *logits,
                            const float *rstd, const float *G, const float *glse, int n,
                            int64_t T, int D, int S, float *gb, int accumulate, float *du_part,
                            int threads) {
    const int64_t rs = T * D;
    const int tiled = G && (int64_t)n * D <= TILE_FLOATS;
#pragma omp parallel num_threads(threads)
    {
        float *du = du_part + (int64_t)omp_get_thread_num() * PAD4(S) * D;
        float zero[D];
        memset(zero, 0, sizeof zero);
#define PHASE1_BACKWARD_TOKEN(QW)                                                               \
    phase1_token_backward(b + t * D, rs, n, D, S, QW, u, lse + t, T, logits + t * n * S,        \
                          rstd + t * n, G ? G + t * D : 0, rs, glse ? glse + t : 0,             \
                          gb ? gb + t * D : 0, accumulate, du, zero, t + PREFETCH_AHEAD < T,    \
                          tiled)
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

/* out = lerp(o1, e, a), a = sigmoid(le - lse), le = r <e, u>: saves a, le, r ([T] each). */
static void merge1_forward(const float *o1, const float *lse, const float *e, const float *u,
                    int64_t T, int D, float eps, float *out, float *a_out, float *le_out,
                    float *r_out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float *et = e + t * D, *ot = o1 + t * D;
        float r, le;
        token_logits(et, 0, 1, D, u, 1, eps, &r, &le);
        const float a = 1.0f / (1.0f + expf(lse[t] - le));
        float *y = out + t * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) y[d] = ot[d] + a * (et[d] - ot[d]);
        a_out[t] = a;
        le_out[t] = le;
        r_out[t] = r;
    }
}

/* d a = <G, e - o1>, d le = a (1 - a) d a; d o1 = G (1 - a), d lse = -d le,
 * d e = G a + r d le u - r^2 / D d le le e, du = sum_t r d le e (per thread). */
static void merge1_backward(const float *o1, const float *e, const float *u, const float *a_in,
                            const float *le_in, const float *r_in, const float *G, int64_t T,
                            int D, float *go1, float *glse, float *ge, int accumulate,
                            float *du_part, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *du = du_part + (int64_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const float *et = e + t * D, *ot = o1 + t * D, *g = G + t * D;
            const float a = a_in[t], r = r_in[t];
            const float da = dot(g, et, D) - dot(g, ot, D);
            const float dle = a * (1.0f - a) * da;
            const float draw = dle * r;
            const float coef = -(r * r / (float)D) * dle * le_in[t];
            glse[t] = -dle;
            if (go1) {
                float *y = go1 + t * D;
#pragma omp simd
                for (int d = 0; d < D; ++d) y[d] = g[d] * (1.0f - a);
            }
            if (ge) {
                float *y = ge + t * D;
                if (accumulate) {
#pragma omp simd
                    for (int d = 0; d < D; ++d) y[d] += g[d] * a + draw * u[d] + coef * et[d];
                } else {
#pragma omp simd
                    for (int d = 0; d < D; ++d) y[d] = g[d] * a + draw * u[d] + coef * et[d];
                }
            }
#pragma omp simd
            for (int d = 0; d < D; ++d) du[d] += draw * et[d];
        }
    }
}

/* Phase 2 with m extra sources e_k ([m, T, D]): le_k = r_k <e_k, u>,
 * total = logaddexp(lse, logsumexp_k le_k), out = exp(lse - total) o1 + sum_k exp(le_k - total) e_k.
 * Saves r and le ([m, T]) and total ([T]). */
static void merge_forward(const float *o1, const float *lse, const float *e, const float *u, int m,
                   int64_t T, int D, float eps, float *out, float *le_out, float *r_out,
                   float *total_out, int threads) {
    const int64_t rs = T * D;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float r[m], le[m];
        const float *et = e + t * D, *ot = o1 + t * D;
        token_logits(et, rs, m, D, u, 1, eps, r, le);
        float mx = lse[t];
        for (int k = 0; k < m; ++k) mx = fmaxf(mx, le[k]);
        float s = expf(lse[t] - mx);
        for (int k = 0; k < m; ++k) s += expf(le[k] - mx);
        const float total = mx + logf(s);
        const float a0 = expf(lse[t] - total);
        float *y = out + t * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) y[d] = a0 * ot[d];
        for (int k = 0; k < m; ++k) {
            const float ak = expf(le[k] - total);
            const float *x = et + k * rs;
#pragma omp simd
            for (int d = 0; d < D; ++d) y[d] += ak * x[d];
            le_out[k * T + t] = le[k];
            r_out[k * T + t] = r[k];
        }
        total_out[t] = total;
    }
}

/* d a0 = <G, o1>, d a_k = <G, e_k>, c = a0 d a0 + sum_k a_k d a_k; d lse = a0 (d a0 - c),
 * d le_k = a_k (d a_k - c); d o1 = a0 G; d e_k = a_k G + r_k d le_k u - r_k^2 / D d le_k le_k e_k;
 * du = sum_{t, k} r_k d le_k e_k (per thread). */
static void merge_backward(const float *o1, const float *lse, const float *e, const float *u,
                           const float *le_in, const float *r_in, const float *total_in,
                           const float *G, int m, int64_t T, int D, float *go1, float *glse,
                           float *ge, int accumulate, float *du_part, int threads) {
    const int64_t rs = T * D;
#pragma omp parallel num_threads(threads)
    {
        float *du = du_part + (int64_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            float a[m], dle[m];
            const float *et = e + t * D, *ot = o1 + t * D, *g = G + t * D;
            const float total = total_in[t];
            const float a0 = expf(lse[t] - total), da0 = dot(g, ot, D);
            float c = a0 * da0;
            for (int k = 0; k < m; ++k) {
                a[k] = expf(le_in[k * T + t] - total);
                dle[k] = dot(g, et + k * rs, D);
                c += a[k] * dle[k];
            }
            glse[t] = a0 * (da0 - c);
            if (go1) {
                float *y = go1 + t * D;
#pragma omp simd
                for (int d = 0; d < D; ++d) y[d] = a0 * g[d];
            }
            for (int k = 0; k < m; ++k) {
                const float dl = a[k] * (dle[k] - c), r = r_in[k * T + t];
                const float draw = dl * r, coef = -(r * r / (float)D) * dl * le_in[k * T + t];
                const float *x = et + k * rs;
                if (ge) {
                    float *y = ge + k * rs + t * D;
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
    }
}

/* The exported entry points take the queries q and key gains g ([S, D] or [D]) as they are and
 * return their gradients: u = g * q is formed here and dL/du (summed over the threads' parts in
 * a fixed order) turned into dL/dq = dL/du * g and dL/dg = dL/du * q, so a call dispatches no
 * torch op around the kernel. gq / gg may be NULL (not needed); accumulate: the blocks' or
 * extras' gradient is added to gb / ge (a gradient buffer other readers add to as well). */
static float *products(const float *q, const float *g, int S, int rows, int D) {
    float *u = calloc((size_t)rows * D, sizeof(float));
    for (int64_t i = 0; u && i < (int64_t)S * D; ++i) u[i] = g[i] * q[i];
    return u;
}

static void query_gain_grads(const float *du_part, int parts, int S, int rows, int D,
                             const float *q, const float *g, float *gq, float *gg) {
    for (int64_t i = 0; i < (int64_t)S * D; ++i) {
        float du = 0.f;
        for (int k = 0; k < parts; ++k) du += du_part[(int64_t)k * rows * D + i];
        if (gq) gq[i] = du * g[i];
        if (gg) gg[i] = du * q[i];
    }
}

/* Returns 0, or -1 when the small work buffers cannot be allocated. */
int phase1_fwd(const float *b, const float *q, const float *g, int n, int64_t T, int D, int S,
               float eps, float *out1, float *lse, float *logits, float *rstd, int threads) {
    float *u = products(q, g, S, PAD4(S), D);
    if (!u) return -1;
    phase1_forward(b, u, n, T, D, S, eps, out1, lse, logits, rstd, threads);
    free(u);
    return 0;
}

int phase1_bwd(const float *b, const float *q, const float *g, const float *lse,
               const float *logits, const float *rstd, const float *G, const float *glse, int n,
               int64_t T, int D, int S, float *gb, int accumulate, float *gq, float *gg,
               int threads) {
    const int S4 = PAD4(S);
    float *u = products(q, g, S, S4, D), *du = calloc((size_t)threads * S4 * D, sizeof(float));
    if (u && du) {
        phase1_backward(b, u, lse, logits, rstd, G, glse, n, T, D, S, gb, accumulate, du,
                        threads);
        query_gain_grads(du, threads, S, S4, D, q, g, gq, gg);
    }
    const int ok = u && du;
    free(u);
    free(du);
    return ok ? 0 : -1;
}

int merge1_fwd(const float *o1, const float *lse, const float *e, const float *q, const float *g,
               int64_t T, int D, float eps, float *out, float *stats, int threads) {
    float *u = products(q, g, 1, 1, D);
    if (!u) return -1;
    merge1_forward(o1, lse, e, u, T, D, eps, out, stats, stats + T, stats + 2 * T, threads);
    free(u);
    return 0;
}

int merge1_bwd(const float *o1, const float *e, const float *q, const float *g,
               const float *stats, const float *G, int64_t T, int D, float *go1, float *glse,
               float *ge, int accumulate, float *gq, float *gg, int threads) {
    float *u = products(q, g, 1, 1, D), *du = calloc((size_t)threads * D, sizeof(float));
    if (u && du) {
        merge1_backward(o1, e, u, stats, stats + T, stats + 2 * T, G, T, D, go1, glse, ge,
                        accumulate, du, threads);
        query_gain_grads(du, threads, 1, 1, D, q, g, gq, gg);
    }
    const int ok = u && du;
    free(u);
    free(du);
    return ok ? 0 : -1;
}

int merge_fwd(const float *o1, const float *lse, const float *e, const float *q, const float *g,
              int m, int64_t T, int D, float eps, float *out, float *stats, int threads) {
    float *u = products(q, g, 1, 1, D);
    if (!u) return -1;
    merge_forward(o1, lse, e, u, m, T, D, eps, out, stats, stats + (int64_t)m * T,
                  stats + 2 * (int64_t)m * T, threads);
    free(u);
    return 0;
}

int merge_bwd(const float *o1, const float *lse, const float *e, const float *q, const float *g,
              const float *stats, const float *G, int m, int64_t T, int D, float *go1,
              float *glse, float *ge, int accumulate, float *gq, float *gg, int threads) {
    float *u = products(q, g, 1, 1, D), *du = calloc((size_t)threads * D, sizeof(float));
    if (u && du) {
        merge_backward(o1, lse, e, u, stats, stats + (int64_t)m * T, stats + 2 * (int64_t)m * T,
                       G, m, T, D, go1, glse, ge, accumulate, du, threads);
        query_gain_grads(du, threads, 1, 1, D, q, g, gq, gg);
    }
    const int ok = u && du;
    free(u);
    free(du);
    return ok ? 0 : -1;
}
