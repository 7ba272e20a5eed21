/* y = x W^T + b in float32 (RTPKV_LINEAR=avx2; WEIGHT_TYPE=BF16 below): the project's own GEMM,
 * for every row count.
 *
 * Packing: output channels in panels of 16 (kernels/fp32_linear.py zero-pads the last one);
 * panel p holds w[p][k][c] = W[16p + c][k], K rows of 16 lanes, so a tile's weights for one k
 * are one or two vector loads.
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
 * Vector width (RTPKV_ISA, kernels/cpu_build.py): built for AVX-512, a panel row is one 16-lane
 * vector, else two 8-lane ones. Each lane is still one output's chain in the order above, so the
 * two builds give the same bits; AVX-512 halves the instructions per FMA (Intel's two 512-bit FMA
 * units double the throughput of a compute-bound tile; Zen 4 runs them as two 256-bit halves).
 *
 * bfloat16 weights (WEIGHT_TYPE=BF16, rtpkv_bf16w_linear): the same panels holding bf16 values,
 * widened to float32 in registers (exact: the 16 bits shifted into the high half), then the same
 * chains: the bits of this kernel over float32 weights equal to the bf16 ones, from half the
 * bytes. A decode step is bound by the bytes of weights it reads.
 *
 * Why not oneDNN: each of its calls costs ~30 us of set-up on the benchmarks' EPYC, a third of
 * a one-row GEMV of a 512x512 layer; a decode step makes one call per linear layer. Tiles: a
 * call with few rows streams the weights once, 1 row x 4 panels or 2-3 rows x 2 panels (8-12
 * independent FMA chains); a call with more rows takes them in blocks of about 512 KiB of x
 * (L2-resident: a prefill's x is read from memory once, not once per panel), and the threads
 * split the panels, each thread the same share in every block (one parallel region a call: no
 * thread waits for another between blocks, which on a busy host, where a thread can lose its
 * core, cost far more than the blocks' work), sweeping them 6 rows at a time: one panel at AVX2
 * (12 accumulators), four at AVX-512 (24 of its 32 registers; one where the panels are too few to
 * give each thread two groups). Neither the blocks nor the tiles change an output's chain.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the float32 linear kernel needs AVX2 and FMA"
#endif

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vloadu _mm512_loadu_ps
#define vstoreu _mm512_storeu_ps
#define vbroadcast(p) _mm512_set1_ps(*(p))
#define vfma _mm512_fmadd_ps
#define vadd _mm512_add_ps
/* LANES bf16 values widened to float32 */
static inline vec vload_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#else
typedef __m256 vec;
#define LANES 8
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vloadu _mm256_loadu_ps
#define vstoreu _mm256_storeu_ps
#define vbroadcast(p) _mm256_broadcast_ss(p)
#define vfma _mm256_fmadd_ps
#define vadd _mm256_add_ps
static inline vec vload_bf16(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#endif

#define PANEL 16         /* output channels per packed panel */
#define VPP (PANEL / LANES)  /* vectors per panel row */
#define K_BLOCK 1024     /* inputs per partial chain (see the header) */
#define TILE_ROWS 6      /* rows per tile when sweeping panels */
#define FEW_ROWS 4       /* below this many rows, the streaming tiles */
/* panels a tile sweeps at once: 12 accumulators at AVX2 (2 vectors a panel row), 24 of
 * AVX-512's 32 registers */
#define SWEEP_PANELS (VPP == 1 ? 4 : 1)
#define ROW_BLOCK_BYTES (512 * 1024)   /* the rows of x the panels sweep in turn: L2-resident */

/* The weights of panel p, input k, vector j of a tile: float32 or bf16 (`bf16` is a constant in
 * every inlined call, so each kernel is compiled with its own load). */
static inline __attribute__((always_inline)) vec wload(const void *w, int bf16, int64_t off) {
    return bf16 ? vload_bf16((const uint16_t *)w + off) : vload((const float *)w + off);
}

/* Rows [0, mr) x panels [0, np) of one tile: y rows at y + r * ldy, column offset c0 of the
 * first panel, `ncols` valid columns from there (the padded tail is not stored). */
static inline __attribute__((always_inline)) void tile(
        const int mr, const int np, const int bf16, const float *x, int64_t K, const void *w,
        float *y, int64_t ldy, const float *bias, int64_t ncols) {
    vec sum[TILE_ROWS][4 * VPP];
    for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {
        const int64_t k1 = k0 + K_BLOCK < K ? k0 + K_BLOCK : K;
        vec acc[TILE_ROWS][4 * VPP];
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < VPP * np; j++) acc[r][j] = vzero();
        for (int64_t k = k0; k < k1; k++) {
            vec wk[4 * VPP];
            for (int p = 0; p < np; p++)
                for (int v = 0; v < VPP; v++)
                    wk[VPP * p + v] = wload(w, bf16, (p * K + k) * PANEL + v * LANES);
            for (int r = 0; r < mr; r++) {
                const vec xb = vbroadcast(x + r * K + k);
                for (int j = 0; j < VPP * np; j++) acc[r][j] = vfma(xb, wk[j], acc[r][j]);
            }
        }
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < VPP * np; j++)
                sum[r][j] = k0 == 0 ? acc[r][j] : vadd(sum[r][j], acc[r][j]);
    }
    for (int r = 0; r < mr; r++) {
        float out[4 * PANEL];
        for (int j = 0; j < VPP * np; j++) {
            vec s = sum[r][j];
            if (bias) s = vadd(s, vloadu(bias + LANES * j));
            vstoreu(out + LANES * j, s);
        }
        memcpy(y + r * ldy, out, (size_t)ncols * sizeof(float));
    }
}

/* The streaming tiles: rows [0, mr < FEW_ROWS) x panels [p, p + np). */
static inline __attribute__((always_inline)) void few_rows(
        int64_t mr, int64_t np, const int bf16, const float *x, int64_t K, const void *w,
        float *y, int64_t ldy, const float *bias, int64_t ncols) {
    const int64_t esize = bf16 ? 2 : 4;
    if (mr == 1 && np == 4) tile(1, 4, bf16, x, K, w, y, ldy, bias, ncols);
    else if (mr == 1) for (int64_t p = 0; p < np; p++)
        tile(1, 1, bf16, x, K, (const char *)w + p * K * PANEL * esize, y + p * PANEL, ldy,
             bias ? bias + p * PANEL : 0, ncols - p * PANEL < PANEL ? ncols - p * PANEL : PANEL);
    else if (np == 2 && mr == 2) tile(2, 2, bf16, x, K, w, y, ldy, bias, ncols);
    else if (np == 2) tile(3, 2, bf16, x, K, w, y, ldy, bias, ncols);
    else if (mr == 2) tile(2, 1, bf16, x, K, w, y, ldy, bias, ncols);
    else tile(3, 1, bf16, x, K, w, y, ldy, bias, ncols);
}

#define PANEL_ROWS_CASE(r) \
    case r: \
        if (np == 4) tile(r, 4, bf16, x, K, w, y, ldy, bias, ncols); \
        else if (np == 3) tile(r, 3, bf16, x, K, w, y, ldy, bias, ncols); \
        else if (np == 2) tile(r, 2, bf16, x, K, w, y, ldy, bias, ncols); \
        else tile(r, 1, bf16, x, K, w, y, ldy, bias, ncols); \
        break;

/* Rows [0, mr <= TILE_ROWS) of panels [0, np <= SWEEP_PANELS). */
static inline __attribute__((always_inline)) void panel_rows(
        int64_t mr, int64_t np, const int bf16, const float *x, int64_t K, const void *w,
        float *y, int64_t ldy, const float *bias, int64_t ncols) {
    switch (mr) {
        PANEL_ROWS_CASE(6) PANEL_ROWS_CASE(5) PANEL_ROWS_CASE(4) PANEL_ROWS_CASE(3)
        PANEL_ROWS_CASE(2) PANEL_ROWS_CASE(1)
    }
}

/* A call's share of work: with few rows a streaming tile's group of panels (4 panels for one
 * row, else 2), with more a panel swept by every row; `units` of them, each computed whole by
 * one thread. Whatever thread runs a unit, its outputs are the same chains. */
static inline int64_t units(int64_t M, int64_t N) {
    const int64_t panels = (N + PANEL - 1) / PANEL, group = M == 1 ? 4 : 2;
    if (M <= 0) return 0;
    return M < FEW_ROWS ? (panels + group - 1) / group : panels;
}

/* Unit u of y = x W^T + b. x: (M, K) row-major; w: packed (panels, K, PANEL) of float32 or bf16
 * (`bf16`); bias: N values or NULL (read up to the padded width: the caller pads it); y: (M, N)
 * row-major. */
static inline __attribute__((always_inline)) void unit(
        const int bf16, const float *x, int64_t M, int64_t K, const void *w, int64_t N,
        const float *bias, float *y, int64_t u) {
    const int64_t panels = (N + PANEL - 1) / PANEL, esize = bf16 ? 2 : 4;
    if (M < FEW_ROWS) {
        const int64_t group = M == 1 ? 4 : 2;    /* panels per streaming tile */
        const int64_t p = u * group;
        const int64_t np = panels - p < group ? panels - p : group;
        const int64_t c0 = p * PANEL, ncols = N - c0 < np * PANEL ? N - c0 : np * PANEL;
        few_rows(M, np, bf16, x, K, (const char *)w + p * K * PANEL * esize, y + c0, N,
                 bias ? bias + c0 : 0, ncols);
        return;
    }
    const int64_t c0 = u * PANEL, ncols = N - c0 < PANEL ? N - c0 : PANEL;
    for (int64_t m = 0; m < M; m += TILE_ROWS) {
        const int64_t mr = M - m < TILE_ROWS ? M - m : TILE_ROWS;
        panel_rows(mr, 1, bf16, x + m * K, K, (const char *)w + u * K * PANEL * esize,
                   y + m * N + c0, N, bias ? bias + c0 : 0, ncols);
    }
}

/* y = x W^T + b over the whole call: few rows by the streaming units, more in L2-sized row blocks
 * whose panels (up to SWEEP_PANELS a tile) the threads split, the same share in every block. */
static inline __attribute__((always_inline)) void linear(
        const int bf16, const float *x, int64_t M, int64_t K, const void *w, int64_t N,
        const float *bias, float *y) {
    if (M <= 0) return;
    if (M < FEW_ROWS) {
        const int64_t n = units(M, N);
#pragma omp parallel for schedule(static)
        for (int64_t u = 0; u < n; u++) unit(bf16, x, M, K, w, N, bias, y, u);
        return;
    }
    /* Blocks of rows that stay in L2 while every panel sweeps them (x is read once from memory,
     * each panel once per block). */
    const int64_t panels = (N + PANEL - 1) / PANEL, esize = bf16 ? 2 : 4;
    int64_t block = ROW_BLOCK_BYTES / (K * (int64_t)sizeof(float)) / TILE_ROWS * TILE_ROWS;
    if (block < TILE_ROWS) block = TILE_ROWS;
    /* wide tiles only where every thread still gets two groups of panels */
    const int64_t sweep = panels >= 2 * SWEEP_PANELS * omp_get_max_threads() ? SWEEP_PANELS : 1;
    const int64_t groups = (panels + sweep - 1) / sweep;
    /* One parallel region: each thread owns the same share of the groups in every block, so no
     * thread waits for another between blocks (each output is written by its group's owner). */
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
        for (int64_t m0 = 0; m0 < M; m0 += block) {
            const int64_t m1 = M - m0 < block ? M : m0 + block;
            for (int64_t g = g0; g < g1; g++) {
                const int64_t p = g * sweep, np = panels - p < sweep ? panels - p : sweep;
                const int64_t c0 = p * PANEL, ncols = N - c0 < np * PANEL ? N - c0 : np * PANEL;
                for (int64_t m = m0; m < m1; m += TILE_ROWS) {
                    const int64_t mr = m1 - m < TILE_ROWS ? m1 - m : TILE_ROWS;
                    panel_rows(mr, np, bf16, x + m * K, K,
                               (const char *)w + p * K * PANEL * esize, y + m * N + c0, N,
                               bias ? bias + c0 : 0, ncols);
                }
            }
        }
    }
}

void rtpkv_fp32_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y) {
    linear(0, x, M, K, w, N, bias, y);
}

void rtpkv_bf16w_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                        const float *bias, float *y) {
    linear(1, x, M, K, w, N, bias, y);
}

/* `count` linear layers of one shape (K inputs, N outputs, no bias) in one parallel region: a
 * mixture's experts, each over its own rows (layer i: x[i], M[i] rows, weights w[i], into
 * y[i]). Every output is the chain rtpkv_fp32_linear (or, `bf16`, rtpkv_bf16w_linear) computes
 * for it: the same units, only shared out over one team instead of one team per layer, which
 * for one-row calls costs more in fork and join than the units themselves. */
void rtpkv_linear_many(int64_t count, const float *const *x, const int64_t *M, int64_t K,
                       const void *const *w, int64_t N, float *const *y, int bf16) {
    int64_t total = 0;
    for (int64_t i = 0; i < count; i++) total += units(M[i], N);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < total; g++) {
        int64_t i = 0, u = g;
        while (u >= units(M[i], N)) u -= units(M[i++], N);
        if (bf16) unit(1, x[i], M[i], K, w[i], N, NULL, y[i], u);
        else unit(0, x[i], M[i], K, w[i], N, NULL, y[i], u);
    }
}
