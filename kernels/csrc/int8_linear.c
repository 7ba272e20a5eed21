/* y = x W^T + b with W stored as int8 and a float32 scale per output channel and group of K
 * (WEIGHT_TYPE=INT8): weight-only quantization, activations and accumulation in float32.
 *
 * Packing: 8 output channels form a block; block j holds q[j][k][c] (int8, K rows of 8 lanes)
 * and s[j][g][c] (float32, one row per group of `group` K values, the last group possibly
 * shorter). A weight's value is w = (float)q * s, one float32 multiply, always the same one.
 *
 * Arithmetic of one output (row m, channel n), whatever the number of rows, the path or the
 * thread count: acc = 0; for k = 0..K-1 in order: acc = fma(x[m][k], w[n][k], acc); then
 * y = acc + b[n] (y = acc without bias). Channels sit in the vector lanes, so each lane is one
 * output's chain and nothing is ever summed across lanes: every row count gives the same bits
 * (batch invariance by construction, no padding).
 * Two paths compute it: few rows stream the int8 weights and widen them in registers, 64
 * channels at a time (the decode GEMV, bound by reading the weights); many rows widen a panel
 * of 16 channels into a float32 buffer once and sweep every row over it (prefill), 6 rows at a
 * time.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the int8 linear kernel needs AVX2 and FMA"
#endif

typedef __m256 v8;

#define LANES 8
#define GEMV_BLOCKS 8    /* channel blocks per GEMV tile: 8 independent FMA chains */
#define PANEL_BLOCKS 2   /* channel blocks per prefill panel (16 channels) */
#define PANEL_ROWS 6     /* rows per prefill tile: 12 accumulators */
/* Channels are packed in a multiple of CHANNEL_MULTIPLE (kernels/int8_linear.py pads with zero
 * weights), so every tile is whole: fixed register tiles, no remainder code. */
#define CHANNEL_MULTIPLE (GEMV_BLOCKS * LANES)

/* 8 weights of block row k: the int8 values widened and scaled. */
static inline v8 widen(const int8_t *q, v8 scale) {
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(w), scale);
}

/* One row of x against channel blocks [b0, b0 + 8), weights widened in registers. */
static void gemv_tile(const float *x, const int8_t *q, const float *s, int64_t k, int64_t group,
                      int64_t groups, int64_t b0, const float *bias, float *y, int64_t n) {
    v8 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const int8_t *qb = q + b0 * k * LANES;
    const int64_t qs = k * LANES;
    for (int64_t g = 0; g < groups; g++) {
        const float *sg = s + (b0 * groups + g) * LANES;
        const int64_t ss = groups * LANES;
        const v8 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + ss),
                 s2 = _mm256_loadu_ps(sg + 2 * ss), s3 = _mm256_loadu_ps(sg + 3 * ss),
                 s4 = _mm256_loadu_ps(sg + 4 * ss), s5 = _mm256_loadu_ps(sg + 5 * ss),
                 s6 = _mm256_loadu_ps(sg + 6 * ss), s7 = _mm256_loadu_ps(sg + 7 * ss);
        const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
        for (int64_t kk = g * group; kk < end; kk++) {
            const v8 xv = _mm256_broadcast_ss(x + kk);
            const int8_t *qk = qb + kk * LANES;
            a0 = _mm256_fmadd_ps(xv, widen(qk, s0), a0);
            a1 = _mm256_fmadd_ps(xv, widen(qk + qs, s1), a1);
            a2 = _mm256_fmadd_ps(xv, widen(qk + 2 * qs, s2), a2);
            a3 = _mm256_fmadd_ps(xv, widen(qk + 3 * qs, s3), a3);
            a4 = _mm256_fmadd_ps(xv, widen(qk + 4 * qs, s4), a4);
            a5 = _mm256_fmadd_ps(xv, widen(qk + 5 * qs, s5), a5);
            a6 = _mm256_fmadd_ps(xv, widen(qk + 6 * qs, s6), a6);
            a7 = _mm256_fmadd_ps(xv, widen(qk + 7 * qs, s7), a7);
        }
    }
    const v8 acc[GEMV_BLOCKS] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int b = 0; b < GEMV_BLOCKS; b++) store_lanes(y, n, (b0 + b) * LANES, acc[b], bias);
}

static void gemv(const float *x, int64_t m, int64_t k, const int8_t *q, const float *s,
                 int64_t n, int64_t group, const float *bias, float *y) {
    const int64_t tiles = (n + CHANNEL_MULTIPLE - 1) / CHANNEL_MULTIPLE;
    const int64_t groups = (k + group - 1) / group;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r = 0; r < m; r++)
            gemv_tile(x + r * k, q, s, k, group, groups, t * GEMV_BLOCKS, bias, y + r * n, n);
}

/* PANEL_ROWS rows of x (row stride ldx) against a widened panel of 2 blocks: panel[b][kk]
 * holds the 8 weights of block b; `rows` of the results are stored. */
static void panel_tile(const float *x, int64_t ldx, int rows, const float *panel, int64_t k,
                       int64_t b0, const float *bias, float *y, int64_t n) {
#define ROW_ACC(r) v8 r##0 = _mm256_setzero_ps(), r##1 = _mm256_setzero_ps()
    ROW_ACC(c0); ROW_ACC(c1); ROW_ACC(c2); ROW_ACC(c3); ROW_ACC(c4); ROW_ACC(c5);
#undef ROW_ACC
    const float *p1 = panel + k * LANES;
    for (int64_t kk = 0; kk < k; kk++) {
        const v8 w0 = _mm256_loadu_ps(panel + kk * LANES), w1 = _mm256_loadu_ps(p1 + kk * LANES);
#define ROW_FMA(r, i)                                                  \
    {                                                                  \
        const v8 xv = _mm256_broadcast_ss(x + (i) * ldx + kk);         \
        r##0 = _mm256_fmadd_ps(xv, w0, r##0);                          \
        r##1 = _mm256_fmadd_ps(xv, w1, r##1);                          \
    }
        ROW_FMA(c0, 0) ROW_FMA(c1, 1) ROW_FMA(c2, 2) ROW_FMA(c3, 3) ROW_FMA(c4, 4) ROW_FMA(c5, 5)
#undef ROW_FMA
    }
    const v8 acc[PANEL_ROWS][PANEL_BLOCKS] = {{c00, c01}, {c10, c11}, {c20, c21},
                                              {c30, c31}, {c40, c41}, {c50, c51}};
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < PANEL_BLOCKS; b++)
            store_lanes(y + r * n, n, (b0 + b) * LANES, acc[r][b], bias);
}

static void panels(const float *x, int64_t m, int64_t k, const int8_t *q, const float *s,
                   int64_t n, int64_t group, const float *bias, float *y) {
    const int64_t groups = (k + group - 1) / group;
    const int64_t count = (n + PANEL_BLOCKS * LANES - 1) / (PANEL_BLOCKS * LANES);
    const int64_t full = m / PANEL_ROWS * PANEL_ROWS;
#pragma omp parallel
    {
        const size_t panel_bytes = (size_t)PANEL_BLOCKS * k * LANES * sizeof(float);
        float *panel = aligned_alloc(32, (panel_bytes + 31) / 32 * 32);
        /* the last rows, zero-padded to a whole tile (padding rows' results are dropped) */
        float *tail = calloc((size_t)PANEL_ROWS * k, sizeof(float));
        memcpy(tail, x + full * k, (size_t)(m - full) * k * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const int64_t b0 = p * PANEL_BLOCKS;
            for (int b = 0; b < PANEL_BLOCKS; b++)
                for (int64_t g = 0; g < groups; g++) {
                    const v8 scale = _mm256_loadu_ps(s + ((b0 + b) * groups + g) * LANES);
                    const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
                    for (int64_t kk = g * group; kk < end; kk++)
                        _mm256_storeu_ps(panel + (b * k + kk) * LANES,
                                         widen(q + ((b0 + b) * k + kk) * LANES, scale));
                }
            for (int64_t r = 0; r < full; r += PANEL_ROWS)
                panel_tile(x + r * k, k, PANEL_ROWS, panel, k, b0, bias, y + r * n, n);
            if (full < m)
                panel_tile(tail, k, (int)(m - full), panel, k, b0, bias, y + full * n, n);
        }
        free(tail);
        free(panel);
    }
}

/* x: m rows of k float32 (contiguous); q, s: packed as above for n channels; bias: n float32 or
 * NULL; y: m rows of n float32. `panel_rows`: the fewest rows that take the panel path. */
void rtpkv_int8_linear(const float *x, int64_t m, int64_t k, const int8_t *q, const float *s,
                       int64_t n, int64_t group, const float *bias, float *y, int64_t panel_rows) {
    if (m >= panel_rows)
        panels(x, m, k, q, s, n, group, bias, y);
    else
        gemv(x, m, k, q, s, n, group, bias, y);
}

/* `count` layers of one shape (k inputs, n outputs, no bias) in one parallel region: a
 * mixture's experts, each over its own rows (layer i: x[i], m[i] rows, weights q[i] and scales
 * s[i], into y[i]). Layers of fewer than `panel_rows` rows share the region's GEMV tiles; the
 * others run one call each on the panel path. Every output is the chain rtpkv_int8_linear
 * computes for it (both its paths compute the same chains): one team instead of one per layer,
 * which for one-row calls costs more in fork and join than the tiles themselves. */
void rtpkv_int8_linear_many(int64_t count, const float *const *x, const int64_t *m, int64_t k,
                            const int8_t *const *q, const float *const *s, int64_t n,
                            int64_t group, float *const *y, int64_t panel_rows) {
    const int64_t tiles = (n + CHANNEL_MULTIPLE - 1) / CHANNEL_MULTIPLE;
    const int64_t groups = (k + group - 1) / group;
    int64_t *few = malloc((size_t)(count ? count : 1) * sizeof(int64_t)), nfew = 0;
    if (!few) abort();
    for (int64_t i = 0; i < count; i++) {
        if (m[i] >= panel_rows)
            panels(x[i], m[i], k, q[i], s[i], n, group, NULL, y[i]);
        else if (m[i] > 0)
            few[nfew++] = i;
    }
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < nfew * tiles; u++) {
        const int64_t i = few[u / tiles], t = u % tiles;
        for (int64_t r = 0; r < m[i]; r++)
            gemv_tile(x[i] + r * k, q[i], s[i], k, group, groups, t * GEMV_BLOCKS, NULL,
                      y[i] + r * n, n);
    }
    free(few);
}
