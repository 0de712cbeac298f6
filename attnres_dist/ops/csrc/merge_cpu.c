/* Phase 2 of two-phase depth attention, forward and backward, fused per token: one sublayer's
 * phase-1 result merged with the sources not in the store by online softmax, for one extra
 * source (the Block partial: a two-way softmax) and for several (Full AttnRes's group outputs).
 */
#include "vector_math.h"

/* One token of the two-way merge: y = lerp(o1, e, a), a = sigmoid(le - lse), le = r <e, u>;
 * a, le, r to *stats, stats[T], stats[2 T]. */
INLINE void merge1_token_forward(const float *ot, float lse, const float *et, const float *u,
                                 int D, float eps, float *y, float *stats, int64_t T) {
    float r, le;
    token_logits(et, 0, 1, D, u, eps, &r, &le);
    const float a = 1.0f / (1.0f + expf(lse - le));
#pragma omp simd
    for (int d = 0; d < D; ++d) y[d] = ot[d] + a * (et[d] - ot[d]);
    stats[0] = a, stats[T] = le, stats[2 * T] = r;
}

/* One token of its backward (g: the output's gradient; see merge1_backward). */
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

/* out = lerp(o1, e, a), a = sigmoid(le - lse), le = r <e, u>: saves a, le, r ([T] each). */
static void merge1_forward(const float *o1, const float *lse, const float *e, const float *u,
                           int64_t T, int D, float eps, float *out, float *stats, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t)
        merge1_token_forward(o1 + t * D, lse[t], e + t * D, u, D, eps, out + t * D, stats + t, T);
}

/* d a = <G, e - o1>, d le = a (1 - a) d a; d o1 = G (1 - a), d lse = -d le,
 * d e = G a + r d le u - r^2 / D d le le e, du = sum_t r d le e (per thread). */
static void merge1_backward(const float *o1, const float *e, const float *u, const float *stats,
                            const float *G, int64_t T, int D, float *go1, float *glse, float *ge,
                            int accumulate, float *du_part, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *du = du_part + (int64_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t)
            merge1_token_backward(o1 + t * D, e + t * D, u, stats[t], stats[T + t],
                                  stats[2 * T + t], G + t * D, D, go1 ? go1 + t * D : 0,
                                  glse + t, ge ? ge + t * D : 0, accumulate, du);
    }
}

/* The two-way merge followed by RMSNorm with gain w (the sublayer's PreNorm), per token: the
 * merged row h stays in L1, y = h rn w with rn = rsqrt(mean(h^2) + norm_eps), computed as
 * rms_norm_cpu.c does; saves a, le, r and rn ([T] each). */
static void merge1_norm_forward(const float *o1, const float *lse, const float *e,
                                const float *u, const float *w, int64_t T, int D, float eps,
                                float norm_eps, float *y, float *stats, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float h[D];
        merge1_token_forward(o1 + t * D, lse[t], e + t * D, u, D, eps, h, stats + t, T);
        const float rn = 1.0f / sqrtf(dot(h, h, D) / (float)D + norm_eps);
        float *yt = y + t * D;
        int d = 0;
        for (; d + VW <= D; d += VW) vstore(yt + d, vload(h + d) * rn * vload(w + d));
        for (; d < D; ++d) yt[d] = h[d] * rn * w[d];
        stats[3 * T + t] = rn;
    }
}

/* Its backward: h is formed again from o1, e and a; the norm's backward (as rms_norm_cpu.c's:
 * dh = rn (G w - h c), c = <G w, h> rn^2 / D; dw = sum_t G h rn, per thread) gives the merge's
 * output gradient, which merge1_token_backward takes. */
static void merge1_norm_backward(const float *o1, const float *e, const float *u, const float *w,
                                 const float *stats, const float *G, int64_t T, int D,
                                 float *go1, float *glse, float *ge, int accumulate,
                                 float *du_part, float *gw_part, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *du = du_part + (int64_t)omp_get_thread_num() * D;
        float *gw = gw_part + (int64_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const float *ot = o1 + t * D, *et = e + t * D, *g = G + t * D;
            const float a = stats[t], rn = stats[3 * T + t];
            float h[D], dh[D];
#pragma omp simd
            for (int d = 0; d < D; ++d) h[d] = ot[d] + a * (et[d] - ot[d]);
            vf acc = {0};
            int d = 0;
            for (; d + VW <= D; d += VW) acc += vload(g + d) * vload(w + d) * vload(h + d);
            float s = vsum(acc);
            for (; d < D; ++d) s += g[d] * w[d] * h[d];
            const float c = s * rn * rn / (float)D;
            for (d = 0; d + VW <= D; d += VW) {
                const vf hv = vload(h + d), gv = vload(g + d);
                vstore(dh + d, (gv * vload(w + d) - hv * c) * rn);
                vstore(gw + d, vload(gw + d) + gv * hv * rn);
            }
            for (; d < D; ++d) {
                dh[d] = (g[d] * w[d] - h[d] * c) * rn;
                gw[d] += g[d] * h[d] * rn;
            }
            merge1_token_backward(ot, et, u, a, stats[T + t], stats[2 * T + t], dh, D,
                                  go1 ? go1 + t * D : 0, glse + t, ge ? ge + t * D : 0,
                                  accumulate, du);
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
        token_logits(et, rs, m, D, u, eps, r, le);
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
            float a[m], dg[m + 1]; /* dg = <G, o1>, then <G, e_k> */
            const float *et = e + t * D, *ot = o1 + t * D, *g = G + t * D, *rows[m + 1];
            rows[0] = ot;
            for (int k = 0; k < m; ++k) rows[k + 1] = et + k * rs;
            dots(g, rows, m + 1, D, dg);
            const float *dle = dg + 1;
            const float total = total_in[t];
            const float a0 = expf(lse[t] - total), da0 = dg[0];
            float c = a0 * da0;
            for (int k = 0; k < m; ++k) {
                a[k] = expf(le_in[k * T + t] - total);
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

int merge1_fwd(const float *o1, const float *lse, const float *e, const float *q, const float *g,
               int64_t T, int D, float eps, float *out, float *stats, int threads) {
    float *u = products(q, g, 1, 1, D);
    if (!u) return -1;
    merge1_forward(o1, lse, e, u, T, D, eps, out, stats, threads);
    free(u);
    return 0;
}

int merge1_bwd(const float *o1, const float *e, const float *q, const float *g,
               const float *stats, const float *G, int64_t T, int D, float *go1, float *glse,
               float *ge, int accumulate, float *gq, float *gg, int threads) {
    BackwardWork w;
    const int ok = work_alloc(&w, q, g, 1, 1, D, threads);
    if (ok)
        merge1_backward(o1, e, w.u, stats, G, T, D, go1, glse, ge, accumulate, w.du, threads);
    return work_finish(&w, ok, threads, 1, 1, D, q, g, gq, gg);
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
    BackwardWork w;
    const int ok = work_alloc(&w, q, g, 1, 1, D, threads);
    if (ok)
        merge_backward(o1, lse, e, w.u, stats, stats + (int64_t)m * T,
                       stats + 2 * (int64_t)m * T, G, m, T, D, go1, glse, ge, accumulate, w.du,
                       threads);
    return work_finish(&w, ok, threads, 1, 1, D, q, g, gq, gg);
}

/* stats [4, T]: a, le, r, rn. */
int merge1_norm_fwd(const float *o1, const float *lse, const float *e, const float *q,
                    const float *g, const float *w, int64_t T, int D, float eps, float norm_eps,
                    float *y, float *stats, int threads) {
    float *u = products(q, g, 1, 1, D);
    if (!u) return -1;
    merge1_norm_forward(o1, lse, e, u, w, T, D, eps, norm_eps, y, stats, threads);
    free(u);
    return 0;
}

/* gw (the norm gain's gradient) may be NULL, like gq and gg. */
int merge1_norm_bwd(const float *o1, const float *e, const float *q, const float *g,
                    const float *w, const float *stats, const float *G, int64_t T, int D,
                    float *go1, float *glse, float *ge, int accumulate, float *gq, float *gg,
                    float *gw, int threads) {
    BackwardWork work;
    float *gw_part = calloc((size_t)threads * D, sizeof(float));
    const int ok = work_alloc(&work, q, g, 1, 1, D, threads) && gw_part;
    if (ok) {
        merge1_norm_backward(o1, e, work.u, w, stats, G, T, D, go1, glse, ge, accumulate,
                             work.du, gw_part, threads);
        for (int d = 0; gw && d < D; ++d) {
            float s = 0.f;
            for (int k = 0; k < threads; ++k) s += gw_part[(int64_t)k * D + d];
            gw[d] = s;
        }
    }
    free(gw_part);
    return work_finish(&work, ok, threads, 1, 1, D, q, g, gq, gg);
}
