/* y = x W^T + b with int8 weights and int8 activations (WEIGHT_TYPE=W8A8_INT8): W quantized at
 * load, symmetric, a float32 scale per output channel and group of GROUP inputs; x quantized at
 * each call the same way, a scale per row and group. The products are integer, so the AVX2
 * integer multiply-adds compute 32 of them in the time the weight-only kernel (int8_linear.c)
 * widens and multiplies 8: a one-row GEMV streams about 1.8x the bytes per second of the
 * weight-only kernel, near the ceiling of the one port both multiply-adds issue on (about
 * 48 GB/s on the benchmark EPYC; docs/BENCHMARKS.md).
 *
 * Quantizing a row's group of x: a = max |x|; sx = a / 127; qx = round-half-even(x / sx),
 * clamped to [-127, 127] (all 0 where sx is 0). The last group is padded with zeros. A group
 * holding a NaN or an infinity gets sx = NaN and qx = 0, so every output of its row is NaN, as
 * in float32 (a NaN never turns into a finite value).
 *
 * Arithmetic of one output (row m, channel n), whatever the number of rows, the tile or the
 * thread count: acc = 0; for each group g in order: isum = sum over the group of
 * qx[m][k] * qw[n][k] (int32, exact, so its order is free); acc = acc + (float)isum *
 * (sw[n][g] * sx[m][g]) (a multiply and an add, not an FMA); then y = acc + b[n]. Every value
 * of isum is below 2^24 in magnitude, so a float32 matmul of the int8 values computes it exactly
 * too: a torch reference gives these bits (kernels/w8a8_linear.py). Batch-invariant by
 * construction, no padding of rows.
 *
 * Packing (kernels/w8a8_linear.py): channels in blocks of 8, blocks in tiles of TILE_BLOCKS
 * (zero-padded to whole tiles), inputs zero-padded to whole groups; tile t holds
 * qw[t][k / 4][b][c][k % 4], so one 32-byte vector is 4 consecutive inputs of a block's 8
 * channels and a tile's weights are one stream in reading order (4 streams, one per block, took
 * 1.4 ms for the bench model's 33 GEMVs against 1.0: the prefetchers follow one stream better);
 * scales sw[j][g][c] per block j. A step broadcasts 4 bytes of x, and vpmaddubsw (|w| times x
 * with w's sign) then vpmaddwd (pairs) gives each channel's sum of 4 products in its 32-bit
 * lane: nothing is summed across lanes.
 *
 * With AVX-512 VNNI (RTPKV_ISA=avx512 on such a CPU) a step takes two blocks in one 64-byte
 * vector and one vpdpbusd per row does what vpmaddubsw, vpmaddwd and the add do. vpdpbusd
 * multiplies unsigned by signed bytes: x goes in offset by 128 (x + 128 in [1, 255], one xor of
 * the broadcast bytes) and one more vpdpbusd a vector, of 128s against the same weights, gives
 * the offset's share 128 * sum(w), subtracted once a group (it does not depend on x: one per
 * vector whatever the number of rows). Putting w's sign on x instead (AVX-512
 * has no vpsignb: abs, a mask and a masked negation a vector, then the vpdpbusd per row) left
 * the one-row GEMV at about 60% of the read roof. The sums are the same integers (vpmaddubsw
 * cannot saturate here: |w| and |x| are at most 127, a pair at most 32,258; the offset sums stay
 * below 2^20), so both builds give the same bits.
 *
 * The one-row GEMV tile (row_tile; decode, and the mixture's experts through
 * rtpkv_w8a8_linear_many) unrolls a group's 8 steps over four accumulator sets (the vpdpbusd
 * chains, not the port, bound it otherwise) and prefetches the next tile's scales: they are a
 * separate array read as four short streams the hardware prefetchers pick up late, a miss each
 * at every tile's start. In a C loop of the mixture bench's experts (8 layers x top 8 of 128,
 * one token, weights from memory, 2 threads) these, the offset and the many-layer call's
 * quantization inside its parallel region took a step's experts to 0.77-0.80x of the time
 * (docs/BENCHMARKS.md).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

#if !defined(__AVX2__)
#error "the w8a8 linear kernel needs AVX2"
#endif

#define LANES 8                 /* channels per block */
#define GROUP 32                /* inputs per scale */
#define STEP 4                  /* inputs per vector step */
#define MANY_BLOCKS 2           /* blocks per tile when sweeping rows over them (prefill) */
#define MANY_ROWS 4             /* rows per tile then */
#define TILE_BLOCKS 4           /* blocks interleaved in one weight stream: a GEMV tile */
#define PREFETCH 4096           /* bytes ahead in the weight stream (measured: 2-8 KB alike, a
                                   quarter faster than the hardware prefetchers alone) */
#define CHANNEL_MULTIPLE (TILE_BLOCKS * LANES)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI512 1
#endif

/* Prefetches the start of a layer's first tile: PREFETCH bytes of its weight stream (from there
 * on the stream's own prefetches run ahead) and the tile's scales. The GEMV tiles of a layer
 * prefetch within it; this is for the tile that follows the layer's last. */
static void prefetch_tile_start(const int8_t *qw, const float *sw, int64_t kp, int64_t groups) {
    const int64_t bytes = kp * TILE_BLOCKS * LANES < PREFETCH ? kp * TILE_BLOCKS * LANES : PREFETCH;
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch((const char *)qw + at, _MM_HINT_T0);
    for (int64_t at = 0; at < TILE_BLOCKS * groups * LANES; at += 64 / sizeof(float))
        _mm_prefetch((const char *)(sw + at), _MM_HINT_T0);
}

/* Quantizes a row of k floats into kp int8 (kp: k rounded up to whole groups, zeros after k)
 * and its scales, one a group. */
static void quantize_row(const float *x, int64_t k, int64_t kp, int8_t *qx, float *sx) {
    for (int64_t g = 0; g < kp / GROUP; g++) {
        const int64_t k0 = g * GROUP, valid = k - k0 < GROUP ? k - k0 : GROUP;
        float buf[GROUP];
        const float *src = x + k0;
        if (valid < GROUP) {   /* the last group, zero-padded */
            memset(buf + valid, 0, (size_t)(GROUP - valid) * sizeof(float));
            memcpy(buf, src, (size_t)valid * sizeof(float));
            src = buf;
        }
        const __m256 sign = _mm256_set1_ps(-0.0f), finite = _mm256_set1_ps(FLT_MAX);
        __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int i = 0; i < GROUP; i += LANES) {
            const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i));
            amax = _mm256_max_ps(amax, v);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, finite, _CMP_NLE_UQ));   /* NaN, inf */
        }
        float lanes[LANES];
        _mm256_storeu_ps(lanes, amax);
        float a = 0.0f;
        for (int i = 0; i < LANES; i++) a = lanes[i] > a ? lanes[i] : a;
        const float s = _mm256_movemask_ps(bad) ? NAN : a / 127.0f;
        sx[g] = s;
        int8_t *q = qx + k0;
        if (!(s > 0.0f)) {   /* zeros, or NaN */
            memset(q, 0, GROUP);
            continue;
        }
        const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f),
                     hi = _mm256_set1_ps(127.0f);
        __m256i ints[GROUP / LANES];
        for (int i = 0; i < GROUP / LANES; i++) {
            __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + i * LANES), sv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            ints[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
        }
        /* to bytes (within [-127, 127]: the saturating packs keep them), back in order */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                                 _mm256_packs_epi32(ints[2], ints[3]));
        _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
            bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
}

/* quantize_row over m rows of x. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t kp, int8_t *qx,
                          float *sx) {
#pragma omp parallel for schedule(static) if (m > 1)
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * k, k, kp, qx + r * kp, sx + r * (kp / GROUP));
}

#ifdef VNNI512
/* Rows [0, R) of qx against blocks [b0, b0 + B) (B even), two blocks per 64-byte vector. x is
 * offset to unsigned (x + 128, one xor of the broadcast bytes) for vpdpbusd's unsigned operand,
 * and a second vpdpbusd of 128s against the same weights gives the offset's share, 128 * sum(w),
 * subtracted at the group's end: two multiply-adds a vector, against abs, a mask, a masked
 * negation and one multiply-add for putting w's sign on x. The group's steps alternate between
 * two sets of accumulators, so twice as many dependency chains are in flight. The same integers,
 * then the epilogue of the AVX2 tile in 16 lanes: the same bits. */
static inline __attribute__((always_inline)) void tile(
        const int R, const int B, const int8_t *qx, const float *sx, int64_t kp, int64_t groups,
        const int8_t *qw, const float *sw, int64_t b0, const float *bias, float *y, int64_t n) {
    const int P = B / 2;   /* block pairs: vectors a step */
    __m512 acc[MANY_ROWS * TILE_BLOCKS / 2];
    for (int i = 0; i < R * P; i++) acc[i] = _mm512_setzero_ps();
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    const int8_t *stream = qw + (b0 / TILE_BLOCKS) * kp * LANES * TILE_BLOCKS
                           + (b0 % TILE_BLOCKS) * LANES * STEP;
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[2][MANY_ROWS * TILE_BLOCKS / 2], shift[2][TILE_BLOCKS / 2];
        for (int h = 0; h < 2; h++) {
            for (int i = 0; i < R * P; i++) dot[h][i] = _mm512_setzero_si512();
            for (int p = 0; p < P; p++) shift[h][p] = _mm512_setzero_si512();
        }
        for (int64_t k0 = g * GROUP; k0 < (g + 1) * GROUP; k0 += 2 * STEP) {
            for (int h = 0; h < 2; h++) {
                const int64_t k = k0 + h * STEP;
                const int8_t *step = stream + k * TILE_BLOCKS * LANES;
                _mm_prefetch((const char *)step + PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)step + PREFETCH + 64, _MM_HINT_T0);
                __m512i xu[MANY_ROWS];
                for (int r = 0; r < R; r++) {
                    uint32_t four;   /* 4 int8 inputs */
                    memcpy(&four, qx + r * kp + k, sizeof four);
                    xu[r] = _mm512_set1_epi32((int)(four ^ 0x80808080u));
                }
                for (int p = 0; p < P; p++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(step + 2 * p * LANES * STEP));
                    shift[h][p] = _mm512_dpbusd_epi32(shift[h][p], offset, w);
                    for (int r = 0; r < R; r++)
                        dot[h][r * P + p] = _mm512_dpbusd_epi32(dot[h][r * P + p], xu[r], w);
                }
            }
        }
        for (int p = 0; p < P; p++) {
            const __m512i off = _mm512_add_epi32(shift[0][p], shift[1][p]);
            const float *s0 = sw + ((b0 + 2 * p) * groups + g) * LANES;
            const __m512 s = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(s0)),
                                                _mm256_loadu_ps(s0 + groups * LANES), 1);
            for (int r = 0; r < R; r++) {
                const __m512i isum = _mm512_sub_epi32(
                    _mm512_add_epi32(dot[0][r * P + p], dot[1][r * P + p]), off);
                const __m512 d = _mm512_mul_ps(s, _mm512_set1_ps(sx[r * groups + g]));
                acc[r * P + p] = _mm512_add_ps(
                    acc[r * P + p], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), d));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            store_lanes(y + r * n, n, (b0 + 2 * p) * LANES, _mm512_castps512_ps256(acc[r * P + p]),
                        bias);
            store_lanes(y + r * n, n, (b0 + 2 * p + 1) * LANES,
                        _mm512_extractf32x8_ps(acc[r * P + p], 1), bias);
        }
}

/* One row against the TILE_BLOCKS blocks of tile b0 / TILE_BLOCKS (the GEMV): `tile` for R = 1,
 * B = TILE_BLOCKS written out, a group's 8 steps unrolled over four sets of accumulators. */
static inline __attribute__((always_inline)) void row_tile(
        const int8_t *qx, const float *sx, int64_t kp, int64_t groups, const int8_t *qw,
        const float *sw, int64_t b0, const float *bias, float *y, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    const int8_t *stream = qw + (b0 / TILE_BLOCKS) * kp * LANES * TILE_BLOCKS;
    const float *s0 = sw + b0 * groups * LANES;
    /* the next tile's scales (a separate array: four short streams the prefetchers miss) */
    for (int64_t at = 0; at < TILE_BLOCKS * groups * LANES; at += 64 / sizeof(float))
        _mm_prefetch((const char *)(s0 + TILE_BLOCKS * groups * LANES + at), _MM_HINT_T0);
    for (int64_t g = 0; g < groups; g++) {
        __m512i d[4][2], c[4][2];
        for (int h = 0; h < 4; h++)
            for (int p = 0; p < 2; p++) d[h][p] = c[h][p] = _mm512_setzero_si512();
        const int8_t *step = stream + g * GROUP * TILE_BLOCKS * LANES;
#pragma GCC unroll 8
        for (int i = 0; i < GROUP / STEP; i++) {
            _mm_prefetch((const char *)step + i * 128 + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)step + i * 128 + PREFETCH + 64, _MM_HINT_T0);
            uint32_t four;
            memcpy(&four, qx + g * GROUP + i * STEP, sizeof four);
            const __m512i xu = _mm512_set1_epi32((int)(four ^ 0x80808080u));
            const __m512i w0 = _mm512_loadu_si512((const void *)(step + i * 128));
            const __m512i w1 = _mm512_loadu_si512((const void *)(step + i * 128 + 64));
            d[i % 4][0] = _mm512_dpbusd_epi32(d[i % 4][0], xu, w0);
            d[i % 4][1] = _mm512_dpbusd_epi32(d[i % 4][1], xu, w1);
            c[i % 4][0] = _mm512_dpbusd_epi32(c[i % 4][0], offset, w0);
            c[i % 4][1] = _mm512_dpbusd_epi32(c[i % 4][1], offset, w1);
        }
        const __m512 xs = _mm512_set1_ps(sx[g]);
        __m512 *acc[2] = {&acc0, &acc1};
        for (int p = 0; p < 2; p++) {
            const __m512i dot = _mm512_add_epi32(_mm512_add_epi32(d[0][p], d[1][p]),
                                                 _mm512_add_epi32(d[2][p], d[3][p]));
            const __m512i off = _mm512_add_epi32(_mm512_add_epi32(c[0][p], c[1][p]),
                                                 _mm512_add_epi32(c[2][p], c[3][p]));
            const float *sp = s0 + (2 * p * groups + g) * LANES;
            const __m512 s = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(sp)),
                                                _mm256_loadu_ps(sp + groups * LANES), 1);
            *acc[p] = _mm512_add_ps(*acc[p], _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, off)), _mm512_mul_ps(s, xs)));
        }
    }
    store_lanes(y, n, b0 * LANES, _mm512_castps512_ps256(acc0), bias);
    store_lanes(y, n, (b0 + 1) * LANES, _mm512_extractf32x8_ps(acc0, 1), bias);
    store_lanes(y, n, (b0 + 2) * LANES, _mm512_castps512_ps256(acc1), bias);
    store_lanes(y, n, (b0 + 3) * LANES, _mm512_extractf32x8_ps(acc1, 1), bias);
}
#else
/* Rows [0, R) of qx against blocks [b0, b0 + B): y rows at y + r * n. The weight of a step is
 * read once for the R rows; the float accumulators live in `acc` between groups. */
static inline __attribute__((always_inline)) void tile(
        const int R, const int B, const int8_t *qx, const float *sx, int64_t kp, int64_t groups,
        const int8_t *qw, const float *sw, int64_t b0, const float *bias, float *y, int64_t n) {
    __m256 acc[MANY_ROWS * TILE_BLOCKS];
    for (int i = 0; i < R * B; i++) acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    /* this tile's stream; block b0 % TILE_BLOCKS + b of a step at `+ b * LANES * STEP` */
    const int8_t *stream = qw + (b0 / TILE_BLOCKS) * kp * LANES * TILE_BLOCKS
                           + (b0 % TILE_BLOCKS) * LANES * STEP;
    for (int64_t g = 0; g < groups; g++) {
        __m256i isum[MANY_ROWS * TILE_BLOCKS];
        for (int i = 0; i < R * B; i++) isum[i] = _mm256_setzero_si256();
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += STEP) {
            __m256i xb[MANY_ROWS];
            for (int r = 0; r < R; r++) {
                int32_t four;   /* 4 int8 inputs */
                memcpy(&four, qx + r * kp + k, sizeof four);
                xb[r] = _mm256_set1_epi32(four);
            }
            const int8_t *step = stream + k * TILE_BLOCKS * LANES;
            _mm_prefetch((const char *)step + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)step + PREFETCH + 64, _MM_HINT_T0);
            for (int b = 0; b < B; b++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(step + b * LANES * STEP));
                const __m256i aw = _mm256_abs_epi8(w);
                for (int r = 0; r < R; r++) {
                    const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb[r], w));
                    isum[r * B + b] = _mm256_add_epi32(isum[r * B + b], _mm256_madd_epi16(p, ones));
                }
            }
        }
        for (int b = 0; b < B; b++) {
            const __m256 s = _mm256_loadu_ps(sw + ((b0 + b) * groups + g) * LANES);
            for (int r = 0; r < R; r++) {
                const __m256 d = _mm256_mul_ps(s, _mm256_set1_ps(sx[r * groups + g]));
                acc[r * B + b] = _mm256_add_ps(
                    acc[r * B + b], _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r * B + b]), d));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            store_lanes(y + r * n, n, (b0 + b) * LANES, acc[r * B + b], bias);
}

/* One row against the TILE_BLOCKS blocks of tile b0 / TILE_BLOCKS (the GEMV), prefetching the
 * next tile's scales as the VNNI row_tile does. */
static inline __attribute__((always_inline)) void row_tile(
        const int8_t *qx, const float *sx, int64_t kp, int64_t groups, const int8_t *qw,
        const float *sw, int64_t b0, const float *bias, float *y, int64_t n) {
    const float *next = sw + (b0 + TILE_BLOCKS) * groups * LANES;
    for (int64_t at = 0; at < TILE_BLOCKS * groups * LANES; at += 64 / sizeof(float))
        _mm_prefetch((const char *)(next + at), _MM_HINT_T0);
    tile(1, TILE_BLOCKS, qx, sx, kp, groups, qw, sw, b0, bias, y, n);
}
#endif

static void few_rows(const int8_t *qx, const float *sx, int64_t m, int64_t kp, const int8_t *qw,
                     const float *sw, int64_t n, const float *bias, float *y) {
    const int64_t groups = kp / GROUP, tiles = (n + CHANNEL_MULTIPLE - 1) / CHANNEL_MULTIPLE;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t b0 = t * TILE_BLOCKS;
        for (int64_t r = 0; r < m; r++)
            row_tile(qx + r * kp, sx + r * groups, kp, groups, qw, sw, b0, bias, y + r * n, n);
    }
}

static void many_rows(const int8_t *qx, const float *sx, int64_t m, int64_t kp, const int8_t *qw,
                      const float *sw, int64_t n, const float *bias, float *y) {
    const int64_t groups = kp / GROUP;
    const int64_t tiles = (n + MANY_BLOCKS * LANES - 1) / (MANY_BLOCKS * LANES);
    const int64_t full = m / MANY_ROWS * MANY_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t b0 = t * MANY_BLOCKS;
        for (int64_t r = 0; r < full; r += MANY_ROWS)
            tile(MANY_ROWS, MANY_BLOCKS, qx + r * kp, sx + r * groups, kp, groups, qw, sw, b0,
                 bias, y + r * n, n);
        for (int64_t r = full; r < m; r++)
            tile(1, MANY_BLOCKS, qx + r * kp, sx + r * groups, kp, groups, qw, sw, b0, bias,
                 y + r * n, n);
    }
}

/* x: m rows of k float32 (contiguous); qw, sw: packed as above for n channels and
 * kp = k rounded up to whole groups; bias: n float32 or NULL; y: m rows of n float32.
 * `many_rows_from`: the fewest rows that take the prefill tiles. */
void rtpkv_w8a8_linear(const float *x, int64_t m, int64_t k, const int8_t *qw, const float *sw,
                       int64_t n, const float *bias, float *y, int64_t many_rows_from) {
    const int64_t kp = (k + GROUP - 1) / GROUP * GROUP;
    int8_t *qx = malloc((size_t)(m * kp) + 1);
    float *sx = malloc((size_t)(m * (kp / GROUP)) * sizeof(float) + 1);
    if (!qx || !sx) abort();   /* a quarter of x's bytes: out of memory is fatal anyway */
    quantize_rows(x, m, k, kp, qx, sx);
    if (m >= many_rows_from)
        many_rows(qx, sx, m, kp, qw, sw, n, bias, y);
    else
        few_rows(qx, sx, m, kp, qw, sw, n, bias, y);
    free(sx);
    free(qx);
}

/* `count` layers of one shape (k inputs, n outputs, no bias) in one parallel region: a
 * mixture's experts, each over its own rows (layer i: x[i], m[i] rows, weights qw[i] and scales
 * sw[i], into y[i]). Layers of fewer than `many_rows_from` rows have their rows quantized as
 * rtpkv_w8a8_linear quantizes them, then share the region's GEMV tiles; the others run one call
 * each. Every output is the one rtpkv_w8a8_linear computes for it: one team instead of one per
 * layer, which for one-row calls costs more in fork and join than the tiles themselves. */
void rtpkv_w8a8_linear_many(int64_t count, const float *const *x, const int64_t *m, int64_t k,
                            const int8_t *const *qw, const float *const *sw, int64_t n,
                            float *const *y, int64_t many_rows_from) {
    const int64_t kp = (k + GROUP - 1) / GROUP * GROUP, groups = kp / GROUP;
    const int64_t tiles = (n + CHANNEL_MULTIPLE - 1) / CHANNEL_MULTIPLE;
    int64_t rows = 0, nfew = 0;
    for (int64_t i = 0; i < count; i++)
        if (m[i] >= many_rows_from)
            rtpkv_w8a8_linear(x[i], m[i], k, qw[i], sw[i], n, NULL, y[i], many_rows_from);
        else
            rows += m[i];
    /* each few-row layer's first quantized row (in qx and sx) and index; each row's source */
    int64_t *few = malloc((size_t)(2 * (count ? count : 1)) * sizeof(int64_t));
    const float **source = malloc((size_t)(rows ? rows : 1) * sizeof(float *));
    int8_t *qx = malloc((size_t)(rows * kp) + 1);
    float *sx = malloc((size_t)(rows * groups) * sizeof(float) + 1);
    if (!few || !source || !qx || !sx) abort();
    int64_t *first = few + count;
    for (int64_t i = 0, row = 0; i < count; i++) {
        if (m[i] >= many_rows_from || m[i] <= 0) continue;
        first[nfew] = row;
        few[nfew++] = i;
        for (int64_t r = 0; r < m[i]; r++) source[row++] = x[i] + r * k;
    }
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(source[r], k, kp, qx + r * kp, sx + r * groups);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < nfew * tiles; u++) {
            const int64_t j = u / tiles, i = few[j], b0 = (u % tiles) * TILE_BLOCKS;
            if (b0 == (tiles - 1) * TILE_BLOCKS && j + 1 < nfew)   /* the next layer's first tile */
                prefetch_tile_start(qw[few[j + 1]], sw[few[j + 1]], kp, groups);
            for (int64_t r = 0; r < m[i]; r++)
                row_tile(qx + (first[j] + r) * kp, sx + (first[j] + r) * groups, kp, groups,
                         qw[i], sw[i], b0, NULL, y[i] + r * n, n);
        }
    }
    free(sx);
    free(qx);
    free(source);
    free(few);
}
