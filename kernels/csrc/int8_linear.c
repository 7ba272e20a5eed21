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
 * Two paths compute it: few rows stream the int8 weights once and widen them in registers (the
 * decode GEMV, bound by reading the weights); many rows widen a panel of 16 channels into a
 * float32 buffer once and sweep every row over it (prefill), 6 rows at a time.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the int8 linear kernel needs AVX2 and FMA"
#endif

typedef __m256 v8;

#define LANES 8
#define GEMV_BLOCKS 4    /* channel blocks per GEMV tile: 4 independent FMA chains per row */
#define GEMV_ROWS 2      /* rows per GEMV tile */
#define PANEL_BLOCKS 2   /* channel blocks per prefill panel (16 channels) */
#define PANEL_ROWS 6     /* rows per prefill tile: 12 accumulators */

/* 8 weights of block row k: the int8 values widened and scaled. */
static inline v8 widen(const int8_t *q, v8 scale) {
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(w), scale);
}

/* Adds the bias and stores the 8 channels of block `block` (the last block may be partial). */
static inline void store_block(float *y, int64_t n, int64_t block, v8 acc, const float *bias) {
    const int64_t n0 = block * LANES, valid = n - n0 < LANES ? n - n0 : LANES;
    float out[LANES];
    if (bias && valid == LANES) {
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + n0));
    } else if (bias) {
        float b[LANES] = {0};
        memcpy(b, bias + n0, valid * sizeof(float));
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(b));
    }
    if (valid == LANES) {
        _mm256_storeu_ps(y + n0, acc);
        return;
    }
    _mm256_storeu_ps(out, acc);
    memcpy(y + n0, out, valid * sizeof(float));
}

/* Rows [0, ROWS) of x against channel blocks [b0, b0 + BLOCKS), weights widened in registers. */
static inline __attribute__((always_inline)) void gemv_tile(
    const float *x, int64_t ldx, const int ROWS, const int8_t *q, const float *s, int64_t k,
    int64_t group, int64_t groups, int64_t b0, const int BLOCKS, const float *bias, float *y,
    int64_t ldy, int64_t n) {
    v8 acc[GEMV_ROWS][GEMV_BLOCKS];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        v8 scale[GEMV_BLOCKS];
        for (int b = 0; b < BLOCKS; b++)
            scale[b] = _mm256_loadu_ps(s + ((b0 + b) * groups + g) * LANES);
        const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
        for (int64_t kk = g * group; kk < end; kk++) {
            v8 w[GEMV_BLOCKS];
            for (int b = 0; b < BLOCKS; b++) w[b] = widen(q + ((b0 + b) * k + kk) * LANES, scale[b]);
            for (int r = 0; r < ROWS; r++) {
                const v8 xv = _mm256_broadcast_ss(x + r * ldx + kk);
                for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm256_fmadd_ps(xv, w[b], acc[r][b]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) store_block(y + r * ldy, n, b0 + b, acc[r][b], bias);
}

static void gemv(const float *x, int64_t m, int64_t k, const int8_t *q, const float *s,
                 int64_t n, int64_t group, const float *bias, float *y) {
    const int64_t blocks = (n + LANES - 1) / LANES, groups = (k + group - 1) / group;
    const int64_t tiles = (blocks + GEMV_BLOCKS - 1) / GEMV_BLOCKS;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t b0 = t * GEMV_BLOCKS;
        const int nb = blocks - b0 < GEMV_BLOCKS ? (int)(blocks - b0) : GEMV_BLOCKS;
        for (int64_t r = 0; r < m; r += GEMV_ROWS) {
            const float *xr = x + r * k;
            float *yr = y + r * n;
            const int rows = m - r < GEMV_ROWS ? (int)(m - r) : GEMV_ROWS;
#define GEMV_CASE(R, B) gemv_tile(xr, k, R, q, s, k, group, groups, b0, B, bias, yr, n, n)
            if (rows == 2) {
                switch (nb) {
                case 4: GEMV_CASE(2, 4); break;
                case 3: GEMV_CASE(2, 3); break;
                case 2: GEMV_CASE(2, 2); break;
                default: GEMV_CASE(2, 1);
                }
            } else {
                switch (nb) {
                case 4: GEMV_CASE(1, 4); break;
                case 3: GEMV_CASE(1, 3); break;
                case 2: GEMV_CASE(1, 2); break;
                default: GEMV_CASE(1, 1);
                }
            }
#undef GEMV_CASE
        }
    }
}

/* Rows [0, ROWS) of x against a widened panel: panel[b][kk] holds the 8 weights of block b. */
static inline __attribute__((always_inline)) void panel_tile(
    const float *x, int64_t ldx, const int ROWS, const float *panel, int64_t k, int64_t b0,
    const int BLOCKS, const float *bias, float *y, int64_t ldy, int64_t n) {
    v8 acc[PANEL_ROWS][PANEL_BLOCKS];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        v8 w[PANEL_BLOCKS];
        for (int b = 0; b < BLOCKS; b++) w[b] = _mm256_loadu_ps(panel + (b * k + kk) * LANES);
        for (int r = 0; r < ROWS; r++) {
            const v8 xv = _mm256_broadcast_ss(x + r * ldx + kk);
            for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm256_fmadd_ps(xv, w[b], acc[r][b]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) store_block(y + r * ldy, n, b0 + b, acc[r][b], bias);
}

static void panels(const float *x, int64_t m, int64_t k, const int8_t *q, const float *s,
                   int64_t n, int64_t group, const float *bias, float *y) {
    const int64_t blocks = (n + LANES - 1) / LANES, groups = (k + group - 1) / group;
    const int64_t count = (blocks + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
#pragma omp parallel
    {
        float *panel = aligned_alloc(32, (size_t)(PANEL_BLOCKS * k * LANES * sizeof(float) + 31)
                                             / 32 * 32);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const int64_t b0 = p * PANEL_BLOCKS;
            const int nb = blocks - b0 < PANEL_BLOCKS ? (int)(blocks - b0) : PANEL_BLOCKS;
            for (int b = 0; b < nb; b++)
                for (int64_t g = 0; g < groups; g++) {
                    const v8 scale = _mm256_loadu_ps(s + ((b0 + b) * groups + g) * LANES);
                    const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
                    for (int64_t kk = g * group; kk < end; kk++)
                        _mm256_storeu_ps(panel + (b * k + kk) * LANES,
                                         widen(q + ((b0 + b) * k + kk) * LANES, scale));
                }
            for (int64_t r = 0; r < m; r += PANEL_ROWS) {
                const float *xr = x + r * k;
                float *yr = y + r * n;
                const int rows = m - r < PANEL_ROWS ? (int)(m - r) : PANEL_ROWS;
#define PANEL_CASE(R) \
    (nb == 2 ? panel_tile(xr, k, R, panel, k, b0, 2, bias, yr, n, n) \
             : panel_tile(xr, k, R, panel, k, b0, 1, bias, yr, n, n))
                switch (rows) {
                case 6: PANEL_CASE(6); break;
                case 5: PANEL_CASE(5); break;
                case 4: PANEL_CASE(4); break;
                case 3: PANEL_CASE(3); break;
                case 2: PANEL_CASE(2); break;
                default: PANEL_CASE(1);
                }
#undef PANEL_CASE
            }
        }
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
