/* Phase 1 of two-phase depth attention on the CPU, shared by phase1_fwd_cpu.c and
 * phase1_bwd_cpu.c: the S queries of a segment attend over the n completed blocks of the store.
 *
 * The torch-ops path (ops/two_phase.py) reads the blocks about ten times per pass (key
 * statistics, logits, mix, and the backward's products and adds) and calls ~30 ops; here each
 * token's n block rows are read from memory once per pass and kept close (a per-thread copy)
 * while the key statistics, logits, softmax, mix and gradients are formed. The forward keeps
 * its logits and key statistics for the backward, which forms p = exp(logit - lse) with the
 * same exponential (exactly 1 for one block).
 *
 * Queries are taken QW at a time: 4, or 2 when S <= 2, or 3 when S = 3 (the per-tile functions
 * are inlined with QW a constant, so their loops unroll into registers; S = 3 pays for no
 * fourth, zero query). u has PAD4(S) rows, zero after S. Each
 * query's tensors (its query and gain [D], its output and output gradient [T, D], its lse and
 * lse gradient [T]) are separate, reached through arrays of S pointers: a sublayer's slice is a
 * tensor of its own, so no [S, ...] stack is formed around the kernels (a NULL gradient pointer
 * is a zero gradient).
 */
#ifndef ATTNRES_DIST_PHASE1_TILE_H
#define ATTNRES_DIST_PHASE1_TILE_H

#include "vector_math.h"

#define PAD4(s) (((s) + 3) & ~3)

/* Tokens are taken VW at a time (a tile): each token's dot products with the queries are
 * formed per row as before (over D in vector chunks), but the key statistics, softmax and
 * log-sum-exps, and in backward the softmax gradient, run across the tile's tokens in vector
 * lanes: per token that bookkeeping is a few scalars per row and query, whose scalar loops,
 * square roots, divisions and logarithms cost more than the dot products at small n. Per-tile
 * arrays are [n, SQ, VW] (row j, query l, lane i at (j SQ + l) VW + i); lanes past the last
 * token hold harmless values and are never written out. The saved logits are [tiles, n, S, VW]
 * and the key statistics [tiles, n, VW] (tiles = ceil(T / VW), see phase1_lanes). */

/* A per-thread copy of a tile's rows ([VW, n, D], token-major) for the passes after the first:
 * a token's n rows lie T D floats apart, the same address modulo 4 KiB, and past the caches'
 * associativity they evict each other between passes. None past TILE_COPY_FLOATS (the rows are
 * then read where they are). */
#define TILE_COPY_FLOATS 65536

static float *tile_copy_alloc(int n, int D) {
    const int64_t floats = (int64_t)VW * n * D;
    return floats <= TILE_COPY_FLOATS ? malloc((size_t)floats * sizeof(float)) : 0;
}

/* The S rows [D] of qs as one [S, D] array (NULL when out of memory). */
static float *gather_rows(const float *const *qs, int S, int D) {
    float *x = malloc((size_t)S * D * sizeof(float));
    for (int l = 0; x && l < S; ++l) memcpy(x + (int64_t)l * D, qs[l], (size_t)D * sizeof(float));
    return x;
}

#endif
