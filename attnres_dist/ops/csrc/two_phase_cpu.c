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
 * Layouts (all contiguous): blocks [n, T, D], u = gains * queries [S, D], out1 / G [S, T, D],
 * lse / grad lse [S, T], extra sources e [m, T, D], out1 slice / grad [T, D]. Accumulation
 * is float32, as in the torch-ops path. Logits are recomputed in backward by the same function as in forward, so
 * they round identically and p = exp(logit - lse) sums to one (exactly 1 for one block).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Short dot products (D is a model width, 64 .. 8192) in LANES independent partial sums, added
 * in a fixed order: compilers turn the inner loop into vector FMAs, the result does not depend
 * on the thread count, and no fast-math flag is needed. */
#define LANES 8

static inline float dot(const float *a, const float *b, int D) {
    float acc[LANES] = {0.f};
    int d = 0;
    for (; d + LANES <= D; d += LANES)
        for (int k = 0; k < LANES; ++k) acc[k] += a[d + k] * b[d + k];
    float s = 0.f;
    for (; d < D; ++d) s += a[d] * b[d];
    for (int k = 0; k < LANES; ++k) s += acc[k];
    return s;
}

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

/* Writes out1, lse and, for the backward, the key statistics r [T, n] and logits [T, n, S]. */
void phase1_forward(const float *b, const float *u, int n, int64_t T, int D, int S, float eps,
                    float *out1, float *lse, float *logits, float *rstd, int threads) {
    const int64_t rs = T * D;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float p[n * S];
        float *r = rstd + t * n, *logit = logits + t * n * S;
        const float *bt = b + t * D;
        token_logits(bt, rs, n, D, u, S, eps, r, logit);
        for (int l = 0; l < S; ++l) {
            float m = logit[l];
            for (int j = 1; j < n; ++j) m = fmaxf(m, logit[j * S + l]);
            float s = 0.f;
            for (int j = 0; j < n; ++j) s += (p[j * S + l] = expf(logit[j * S + l] - m));
            const float inv = 1.0f / s;
            for (int j = 0; j < n; ++j) p[j * S + l] *= inv;
            lse[l * T + t] = m + logf(s);
        }
        for (int l = 0; l < S; ++l) {
            float *o = out1 + ((int64_t)l * T + t) * D;
            const float p0 = p[l];
#pragma omp simd
            for (int d = 0; d < D; ++d) o[d] = p0 * bt[d];
            for (int j = 1; j < n; ++j) {
                const float *x = bt + j * rs;
                const float w = p[j * S + l];
#pragma omp simd
                for (int d = 0; d < D; ++d) o[d] += w * x[d];
            }
        }
    }
}

/* d b_j = sum_l p_lj G_l + sum_l draw_lj u_l - r_j^2 / D (sum_l dlogit_lj logit_lj) b_j,
 * dlogit_lj = p_lj (<G_l, b_j> - sum_j' p_lj' <G_l, b_j'> + dlse_l), draw = r_j dlogit;
 * du_l = sum_{t, j} draw_lj b_j, accumulated per thread into du_part[thread]. */
void phase1_backward(const float *b, const float *u, const float *lse, const float *logits,
                     const float *rstd, const float *G, const float *glse, int n, int64_t T,
                     int D, int S, float *gb, float *du_part, int threads) {
    const int64_t rs = T * D;
#pragma omp parallel num_threads(threads)
    {
        float *du = du_part + (int64_t)omp_get_thread_num() * S * D;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            float p[n * S], dl[n * S], coef[n];
            const float *r = rstd + t * n, *logit = logits + t * n * S;
            const float *bt = b + t * D;
            for (int l = 0; l < S; ++l) {
                const float lv = lse[l * T + t];
                const float *g = G ? G + ((int64_t)l * T + t) * D : 0;
                float c = 0.f;
                for (int j = 0; j < n; ++j) {
                    const float pj = expf(logit[j * S + l] - lv);
                    const float dp = g ? dot(g, bt + j * rs, D) : 0.f;
                    p[j * S + l] = pj;
                    dl[j * S + l] = dp;
                    c += pj * dp;
                }
                const float gl = glse ? glse[l * T + t] : 0.f;
                for (int j = 0; j < n; ++j)
                    dl[j * S + l] = p[j * S + l] * (dl[j * S + l] - c + gl);
            }
            for (int j = 0; j < n; ++j) {
                float acc = 0.f;
                for (int l = 0; l < S; ++l) acc += dl[j * S + l] * logit[j * S + l];
                coef[j] = -(r[j] * r[j] / (float)D) * acc;
            }
            for (int j = 0; j < n; ++j) {
                const float *x = bt + j * rs;
                float *y = gb ? gb + j * rs + t * D : 0;
                if (y) {
                    const float cj = coef[j];
#pragma omp simd
                    for (int d = 0; d < D; ++d) y[d] = cj * x[d];
                }
                for (int l = 0; l < S; ++l) {
                    const float draw = dl[j * S + l] * r[j];
                    const float *ul = u + (int64_t)l * D;
                    float *dul = du + (int64_t)l * D;
#pragma omp simd
                    for (int d = 0; d < D; ++d) dul[d] += draw * x[d];
                    if (y) {
                        const float pj = p[j * S + l];
                        const float *g = G ? G + ((int64_t)l * T + t) * D : 0;
                        if (g) {
#pragma omp simd
                            for (int d = 0; d < D; ++d) y[d] += pj * g[d] + draw * ul[d];
                        } else {
#pragma omp simd
                            for (int d = 0; d < D; ++d) y[d] += draw * ul[d];
                        }
                    }
                }
            }
        }
    }
}

/* out = lerp(o1, e, a), a = sigmoid(le - lse), le = r <e, u>: saves a, le, r ([T] each). */
void merge1_forward(const float *o1, const float *lse, const float *e, const float *u,
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
void merge1_backward(const float *o1, const float *e, const float *u, const float *a_in,
                     const float *le_in, const float *r_in, const float *G, int64_t T, int D,
                     float *go1, float *glse, float *ge, float *du_part, int threads) {
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
#pragma omp simd
                for (int d = 0; d < D; ++d) y[d] = g[d] * a + draw * u[d] + coef * et[d];
            }
#pragma omp simd
            for (int d = 0; d < D; ++d) du[d] += draw * et[d];
        }
    }
}

/* Phase 2 with m extra sources e_k ([m, T, D]): le_k = r_k <e_k, u>,
 * total = logaddexp(lse, logsumexp_k le_k), out = exp(lse - total) o1 + sum_k exp(le_k - total) e_k.
 * Saves r and le ([m, T]) and total ([T]). */
void merge_forward(const float *o1, const float *lse, const float *e, const float *u, int m,
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
void merge_backward(const float *o1, const float *lse, const float *e, const float *u,
                    const float *le_in, const float *r_in, const float *total_in, const float *G,
                    int m, int64_t T, int D, float *go1, float *glse, float *ge, float *du_part,
                    int threads) {
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
#pragma omp simd
                    for (int d = 0; d < D; ++d) y[d] = ak * g[d] + draw * u[d] + coef * x[d];
                }
#pragma omp simd
                for (int d = 0; d < D; ++d) du[d] += draw * x[d];
            }
        }
    }
}
