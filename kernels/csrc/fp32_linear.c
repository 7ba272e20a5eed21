/* y = x W^T + b in float32 (RTPKV_LINEAR=avx2): the project's own GEMM, for every row count.
 *
 * Packing: output channels in panels of 16 (kernels/fp32_linear.py zero-pads the last one);
 * panel p holds w[p][k][c] = W[16p + c][k], K rows of 16 lanes, so a tile's weights for one k
 * are two aligned vector loads.
 *
 * Arithmetic of one output (row m, channel n), whatever the number of rows, the tile or the
 * thread count: the inputs are taken in blocks of K_BLOCK in order; within a block
 * acc = fma(x[m][k], W[n][k], acc) from acc = 0, k in order; the blocks' sums are added in
 * order (s = acc_0, s = s + acc_1, ...); then y = s + b[n]. Channels sit in the vector lanes,
 * so each lane is one output's chain and nothing is summed across lanes: every row count gives
 * the same bits (batch invariance by construction, no padding, no probe). The blocks of 1024
 * are oneDNN's order for float32 on AVX2, so on such a CPU this path gives the bits the onednn
 * path gives (tests/kernels/test_fp32_linear.py checks it there).
 *
 * Why not oneDNN: each of its calls costs ~30 us of set-up on the benchmarks' EPYC, a third of
 * a one-row GEMV of a 512x512 layer; a decode step makes one call per linear layer. Tiles: a
 * call with few rows streams the weights once, 1 row x 4 panels or 2-3 rows x 2 panels (8-12
 * independent FMA chains); a call with more rows sweeps each panel with 6 rows at a time (12
 * accumulators), the panel staying in cache while the rows pass.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the float32 linear kernel needs AVX2 and FMA"
#endif

typedef __m256 v8;

#define PANEL 16         /* output channels per packed panel: two vectors */
#define K_BLOCK 1024     /* inputs per partial chain (see the header) */
#define TILE_ROWS 6      /* rows per tile when sweeping a panel */
#define FEW_ROWS 4       /* below this many rows, the streaming tiles */

/* Rows [0, mr) x panels [0, np) of one tile: y rows at y + r * ldy, column offset c0 of the
 * first panel, `ncols` valid columns from there (the padded tail is not stored). */
static inline __attribute__((always_inline)) void tile(
        const int mr, const int np, const float *x, int64_t K, const float *w, float *y,
        int64_t ldy, const float *bias, int64_t ncols) {
    v8 sum[TILE_ROWS][8];
    for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {
        const int64_t k1 = k0 + K_BLOCK < K ? k0 + K_BLOCK : K;
        v8 acc[TILE_ROWS][8];
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < 2 * np; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            v8 wk[8];
            for (int p = 0; p < np; p++) {
                wk[2 * p] = _mm256_load_ps(w + (p * K + k) * PANEL);
                wk[2 * p + 1] = _mm256_load_ps(w + (p * K + k) * PANEL + 8);
            }
            for (int r = 0; r < mr; r++) {
                const v8 xb = _mm256_broadcast_ss(x + r * K + k);
                for (int j = 0; j < 2 * np; j++) acc[r][j] = _mm256_fmadd_ps(xb, wk[j], acc[r][j]);
            }
        }
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < 2 * np; j++)
                sum[r][j] = k0 == 0 ? acc[r][j] : _mm256_add_ps(sum[r][j], acc[r][j]);
    }
    for (int r = 0; r < mr; r++) {
        float out[8 * 8];
        for (int j = 0; j < 2 * np; j++) {
            v8 s = sum[r][j];
            if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + 8 * j));
            _mm256_storeu_ps(out + 8 * j, s);
        }
        memcpy(y + r * ldy, out, (size_t)ncols * sizeof(float));
    }
}

/* The streaming tiles: rows [0, mr < FEW_ROWS) x panels [p, p + np). */
static void few_rows(int64_t mr, int64_t np, const float *x, int64_t K, const float *w,
                     float *y, int64_t ldy, const float *bias, int64_t ncols) {
    if (mr == 1 && np == 4) tile(1, 4, x, K, w, y, ldy, bias, ncols);
    else if (mr == 1) for (int64_t p = 0; p < np; p++)
        tile(1, 1, x, K, w + p * K * PANEL, y + p * PANEL, ldy, bias ? bias + p * PANEL : 0,
             ncols - p * PANEL < PANEL ? ncols - p * PANEL : PANEL);
    else if (np == 2 && mr == 2) tile(2, 2, x, K, w, y, ldy, bias, ncols);
    else if (np == 2) tile(3, 2, x, K, w, y, ldy, bias, ncols);
    else if (mr == 2) tile(2, 1, x, K, w, y, ldy, bias, ncols);
    else tile(3, 1, x, K, w, y, ldy, bias, ncols);
}

/* Rows [0, mr <= TILE_ROWS) of one panel. */
static void panel_rows(int64_t mr, const float *x, int64_t K, const float *w, float *y,
                       int64_t ldy, const float *bias, int64_t ncols) {
    switch (mr) {
    case 6: tile(6, 1, x, K, w, y, ldy, bias, ncols); break;
    case 5: tile(5, 1, x, K, w, y, ldy, bias, ncols); break;
    case 4: tile(4, 1, x, K, w, y, ldy, bias, ncols); break;
    case 3: tile(3, 1, x, K, w, y, ldy, bias, ncols); break;
    case 2: tile(2, 1, x, K, w, y, ldy, bias, ncols); break;
    default: tile(1, 1, x, K, w, y, ldy, bias, ncols); break;
    }
}

/* x: (M, K) row-major; w: packed (panels, K, PANEL), 32-byte aligned; bias: N values or NULL
 * (read up to the padded width: the caller pads it); y: (M, N) row-major. */
void rtpkv_fp32_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (M <= 0) return;
    if (M < FEW_ROWS) {
        const int64_t group = M == 1 ? 4 : 2;    /* panels per streaming tile */
        const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p = g * group;
            const int64_t np = panels - p < group ? panels - p : group;
            const int64_t c0 = p * PANEL, ncols = N - c0 < np * PANEL ? N - c0 : np * PANEL;
            few_rows(M, np, x, K, w + p * K * PANEL, y + c0, N, bias ? bias + c0 : 0, ncols);
        }
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t c0 = p * PANEL, ncols = N - c0 < PANEL ? N - c0 : PANEL;
        for (int64_t m = 0; m < M; m += TILE_ROWS) {
            const int64_t mr = M - m < TILE_ROWS ? M - m : TILE_ROWS;
            panel_rows(mr, x + m * K, K, w + p * K * PANEL, y + m * N + c0, N,
                       bias ? bias + c0 : 0, ncols);
        }
    }
}
