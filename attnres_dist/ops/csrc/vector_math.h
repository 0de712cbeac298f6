/* Shared by the CPU kernels (phase 1, the merges, RMSNorm): the vector type, dot products, the
 * vectorised exponential and logarithm, prefetch, and the entry points' handling of queries and
 * gains.
 *
 * Layouts (all contiguous, float32): blocks [n, T, D], queries / gains [S, D] (phase 1) or [D]
 * (phase 2), u = gains * queries, out1 / its gradient G [S, T, D], lse and its gradient
 * [S, T], extra sources e [m, T, D], a phase-1 slice and its gradient [T, D]. Tokens are split
 * over OpenMP threads (torch's own libgomp, already loaded under the same soname).
 */
#ifndef ATTNRES_DIST_VECTOR_MATH_H
#define ATTNRES_DIST_VECTOR_MATH_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* VW-float vectors (GCC / clang vector extensions), loaded and stored unaligned: sixteen floats
 * (one zmm register) where the compiler targets AVX-512, which runs phase 1's loops in 0.72-0.96
 * of the eight-float time on the CPUs measured; else eight (AVX2 registers on x86, two NEON
 * registers on arm64). Every sum is formed in a fixed order, so no fast-math flag is needed
 * and a token's result does not depend on the thread count (it does on VW: sums are folded
 * from VW lanes). */
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
#define VW 16
#else
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define VW 8
#endif
typedef float vf8 __attribute__((vector_size(32))); /* the horizontal sums' first fold */

/* Four-float vectors: four rows' dot products, summed in one shuffle tree. */
typedef float vf4 __attribute__((vector_size(16)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* v's sixteen lanes folded to eight (halves added); eight-float v as it is. */
static inline vf8 fold8(vf v) {
#if VW == 16
    return (vf8){v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]} +
           (vf8){v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
#else
    return v;
#endif
}

static inline float vsum(vf w) {
    const vf8 v = fold8(w);
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* (vsum(a), vsum(b), vsum(c), vsum(d)), each in vsum's order, sharing the shuffles: folded to
 * eight lanes, halves folded 8 -> 4, pairs of vectors' halves 4 -> 2, then adjacent lanes
 * 2 -> 1. */
static inline vf4 lo4(vf8 v) { return (vf4){v[0], v[1], v[2], v[3]}; }
static inline vf4 hi4(vf8 v) { return (vf4){v[4], v[5], v[6], v[7]}; }

static inline vf4 vsum4(vf wa, vf wb, vf wc, vf wd) {
    const vf8 a = fold8(wa), b = fold8(wb), c = fold8(wc), d = fold8(wd);
    const vf4 a4 = lo4(a) + hi4(a), b4 = lo4(b) + hi4(b);
    const vf4 c4 = lo4(c) + hi4(c), d4 = lo4(d) + hi4(d);
    const vf4 ab = (vf4){a4[0], a4[1], b4[0], b4[1]} + (vf4){a4[2], a4[3], b4[2], b4[3]};
    const vf4 cd = (vf4){c4[0], c4[1], d4[0], d4[1]} + (vf4){c4[2], c4[3], d4[2], d4[3]};
    return (vf4){ab[0], ab[2], cd[0], cd[2]} + (vf4){ab[1], ab[3], cd[1], cd[3]};
}

static inline float dot(const float *a, const float *b, int D) {
    vf acc = {0};
    int d = 0;
    for (; d + VW <= D; d += VW) acc += vload(a + d) * vload(b + d);
    float s = vsum(acc);
    for (; d < D; ++d) s += a[d] * b[d];
    return s;
}

/* exp of VW floats (Cephes' expf): x = k ln2 + r, |r| <= ln2 / 2, exp r = 1 + r + r^2 P(r)
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

/* ln x of VW floats (Cephes' logf, ~1 ulp) for normal x > 0: x = m 2^e with m in
 * [sqrt(1/2), sqrt(2)), ln x = e ln2 + ln m by a polynomial in m - 1. ln 1 is exactly 0. */
static inline vf vlog(vf x) {
    const vi bits = (vi)x;
    vi e = ((bits >> 23) & 0xff) - 126; /* x = m 2^e, m in [1/2, 1) */
    vf m = (vf)((bits & 0x807fffff) | 0x3f000000);
    const vi small = m < 0.707106781186547524f; /* then m 2 and e - 1 */
    e += small;
    m = m + (vf)((vi)m & small) - 1.0f;
    const vf z = m * m;
    vf y = m * 7.0376836292e-2f - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    const vf fe = __builtin_convertvector(e, vf);
    y += fe * -2.12194440e-4f;
    y += z * -0.5f;
    return (m + y) + fe * 0.693359375f;
}

static inline vf vmax(vf a, vf b) {
    const vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* 1 / sqrt(sq / D + eps) per lane: a row's key statistic from its sum of squares. */
static inline vf vrsqrt_mean(vf sq, int D, float eps) {
    float a[VW];
    vstore(a, sq / (float)D + eps);
#pragma omp simd
    for (int i = 0; i < VW; ++i) a[i] = 1.0f / sqrtf(a[i]);
    return vload(a);
}

/* Tokens are taken VW at a time where per-token scalars (softmax weights, key statistics)
 * are formed across tokens in vector lanes: lanes i < tt of v[t0 + i] (0 past them, or
 * everywhere for a NULL v), and their store. */
#define TILES(T) (((T) + VW - 1) / VW)                                  /* tiles of T tokens */
#define TILE_TOKENS(T, k) ((int)((T) - (k) * VW < VW ? (T) - (k) * VW : VW)) /* in tile k */

static inline vf vload_lanes(const float *v, int64_t t0, int tt) {
    vf out = {0};
    if (!v) return out;
    if (tt == VW) return vload(v + t0);
    for (int i = 0; i < tt; ++i) out[i] = v[t0 + i];
    return out;
}

static inline void vstore_lanes(float *v, int64_t t0, int tt, vf x) {
    if (tt == VW) {
        vstore(v + t0, x);
        return;
    }
    for (int i = 0; i < tt; ++i) v[t0 + i] = x[i];
}

/* A token's n rows lie T * D floats apart: n streams, more than the hardware prefetchers
 * follow once n passes ~16, so each pass asks for the rows of the token PREFETCH_AHEAD ahead. */
#define PREFETCH_AHEAD 4

static inline void prefetch_row(const float *x, int D) {
    for (int d = 0; d < D; d += 16) __builtin_prefetch(x + d, 0, 3);
}

#define INLINE static inline __attribute__((always_inline))

/* out[k] = <x, w[k]> for QW (2 or 4, a constant where inlined) rows w[k]; *sq = <x, x> and
 * copy[d] = x[d] when they are not NULL. The accumulators are named, not an array, so they stay
 * in registers. */
INLINE void dotsq(const float *restrict x, const float *const *w, int D, const int QW,
                  float *restrict out, float *restrict sq, float *restrict copy) {
    const float *restrict w0 = w[0], *restrict w1 = w[1];
    const float *restrict w2 = QW > 2 ? w[2] : w[0], *restrict w3 = QW > 3 ? w[3] : w[0];
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, aq = {0};
    int d = 0;
    for (; d + VW <= D; d += VW) {
        const vf xv = vload(x + d);
        if (copy) vstore(copy + d, xv);
        aq += xv * xv;
        a0 += xv * vload(w0 + d);
        a1 += xv * vload(w1 + d);
        if (QW > 2) a2 += xv * vload(w2 + d);
        if (QW > 3) a3 += xv * vload(w3 + d);
    }
    /* the sum of squares takes a free slot of the four-way reduction where there is one */
    const vf4 sums = QW > 3   ? vsum4(a0, a1, a2, a3)
                     : QW > 2 ? vsum4(a0, a1, a2, aq)
                              : vsum4(a0, a1, aq, aq);
    float s0 = sums[0], s1 = sums[1], s2 = QW > 2 ? sums[2] : 0.f, s3 = QW > 3 ? sums[3] : 0.f;
    float q = QW > 3 ? (sq ? vsum(aq) : 0.f) : sums[QW > 2 ? 3 : 2];
    for (; d < D; ++d) {
        if (copy) copy[d] = x[d];
        q += x[d] * x[d];
        s0 += x[d] * w0[d];
        s1 += x[d] * w1[d];
        if (QW > 2) s2 += x[d] * w2[d];
        if (QW > 3) s3 += x[d] * w3[d];
    }
    out[0] = s0, out[1] = s1;
    if (QW > 2) out[2] = s2;
    if (QW > 3) out[3] = s3;
    if (sq) *sq = q;
}

/* r[j] = rsqrt(mean(b_j^2) + eps) and logit[j] = r[j] <b_j, u> for one token (one query):
 * both sums of a row in one pass. */
static inline void token_logits(const float *b, int64_t row_stride, int n, int D, const float *u,
                                float eps, float *r, float *logit) {
    const float *w[2] = {u, u};
    for (int j = 0; j < n; ++j) {
        float s[2], sq;
        dotsq(b + j * row_stride, w, D, 2, s, &sq, 0);
        r[j] = 1.0f / sqrtf(sq / (float)D + eps);
        logit[j] = r[j] * s[0];
    }
}

/* out[i] = <x, rows[i]> for i < count, four rows per pass over x. */
static inline void dots(const float *x, const float *const *rows, int count, int D, float *out) {
    int i = 0;
    for (; i + 4 <= count; i += 4) dotsq(x, rows + i, D, 4, out + i, 0, 0);
    for (; i < count; i += 2) {
        const float *w[2] = {rows[i], rows[i + 1 < count ? i + 1 : i]};
        float s[2];
        dotsq(x, w, D, 2, s, 0, 0);
        out[i] = s[0];
        if (i + 1 < count) out[i + 1] = s[1];
    }
}

/* The exported entry points take the queries q and key gains g ([S, D] or [D]) as they are and
 * return their gradients: u = g * q is formed here and dL/du (summed over the threads' parts in
 * a fixed order) turned into dL/dq = dL/du * g and dL/dg = dL/du * q, so a call dispatches no
 * torch op around the kernel. gq / gg may be NULL (not needed); accumulate: the blocks' or
 * extras' gradient is added to gb / ge (a gradient buffer other readers add to as well). */
static inline float *products(const float *q, const float *g, int S, int rows, int D) {
    float *u = calloc((size_t)rows * D, sizeof(float));
    for (int64_t i = 0; u && i < (int64_t)S * D; ++i) u[i] = g[i] * q[i];
    return u;
}

static inline void query_gain_grads(const float *du_part, int parts, int S, int rows, int D,
                             const float *q, const float *g, float *gq, float *gg) {
    for (int64_t i = 0; i < (int64_t)S * D; ++i) {
        float du = 0.f;
        for (int k = 0; k < parts; ++k) du += du_part[(int64_t)k * rows * D + i];
        if (gq) gq[i] = du * g[i];
        if (gg) gg[i] = du * q[i];
    }
}

/* A backward call's work buffers: u (rows rows, zero after S) and the threads' dL/du parts. */
typedef struct {
    float *u, *du;
} BackwardWork;

/* Allocates the work; 1 when both buffers were allocated. */
static inline int work_alloc(BackwardWork *w, const float *q, const float *g, int S, int rows,
                             int D, int threads) {
    w->u = products(q, g, S, rows, D);
    w->du = calloc((size_t)threads * rows * D, sizeof(float));
    return w->u && w->du;
}

/* Turns dL/du into dL/dq and dL/dg when the kernel ran, frees the work; 0, or -1 when it could
 * not run. */
static inline int work_finish(BackwardWork *w, int ran, int threads, int S, int rows, int D,
                              const float *q, const float *g, float *gq, float *gg) {
    if (ran) query_gain_grads(w->du, threads, S, rows, D, q, g, gq, gg);
    free(w->u);
    free(w->du);
    return ran ? 0 : -1;
}

#endif
