/* Paged attention on the CPU, reading K/V blocks in place from the head-major pool.
 *
 * Every query token attends to positions [0, pos] of its sequence (with an attention window W:
 * [pos - W + 1, pos], and blocks wholly before that are never read: their table entries may be
 * released), block by block in position order, with an online softmax.
 *
 * Batch invariance. The arithmetic done for one query depends only on that query, its position
 * and the cached K/V it reads: not on how many other tokens share the batch, nor on where its
 * prefill chunk starts, nor on the thread that runs it. That makes prefix reuse, chunked
 * prefill and batching bit-exact (the guarantee of rtpkv). For one query row and one block:
 *   p_c     = for each c < 8, an fma chain over d = c, c + 8, c + 16, ... < D in order, from 0:
 *             p_c = fma(q[d], k[j][d], p_c);
 *   score_j = ((p_0 + p_1) + (p_2 + p_3)) + ((p_4 + p_5) + (p_6 + p_7));
 *   x_j     = score_j * scale (with a soft-cap c: c * tanh(score_j * scale / c), vec_math.h's
 *             softcap8, or its 16-lane softcap16), or -inf outside the query's keys [first, valid);
 *   m'      = max(m, x_0, x_1, ...);  z = (m' == -inf ? 0 : m');  alpha = exp(m - z);
 *   w_j     = exp(x_j - z);  sum = ((0 + w_0) + w_1) + ...;  l = fma(l, alpha, sum);
 *   acc[d]  = acc[d] * alpha, then the chain acc[d] = fma(w_j, v[j][d], acc[d]) over j in order;
 * and finally out[d] = acc[d] * (1 / l). Keys past a query's last one only ever add exact zeros.
 * m and l start at -inf and 0, or with attention sinks at the head's sink logit s and 1
 * (exp(s - s)): the sink then joins the denominator as one more key with no value, whatever
 * the keys.
 *
 * Two vectorisations compute exactly that. Tiles of at least 8 query rows (prefill) put 8 query
 * rows in the lanes of a vector (16 where the build has AVX-512: RTPKV_ISA, kernels/cpu_build.py),
 * so K and V are read in place as broadcasts and the softmax runs on a vector of rows at once
 * (a block that every row of the tile reads whole skips the mask: its scores come out of the
 * score tile scaled, with their row maxima); smaller tiles (decodes: the G query
 * heads of one token) put the head dimension in the lanes, so a key's 8 partial chains are one
 * vector of FMAs over its row, read in place, and 4 keys' vectors are reduced by the tree above
 * at once with horizontal adds (hadd adds neighbouring lanes, and a sum's bits do not depend on
 * the order of its two operands; with AVX-512 two keys share a vector, one per 8-lane half);
 * the values' columns are in the lanes. Each lane computes its own row's (or chain's, or
 * column's) arithmetic above whatever the vector width, so every ISA level gives the same bits
 * (tests/kernels/test_isa_levels.py).
 *
 * Work items are (kv head, tile of up to TILE consecutive tokens of one sequence): the query
 * heads of a GQA group and the tile's tokens share each block read while it is in cache.
 *
 * K/V of bfloat16 or int8 (the int8 cache: rows of D int8 values and their float32 scale,
 * kernels/kv_quant.py) are widened block by block, as each block is read, into the thread's
 * B x D float tile (L1-resident): an int8 value becomes float(q) * scale, then the float32
 * arithmetic above runs unchanged, so the int8 cache gives the bits of a float32 cache holding
 * the dequantized values. No dequantized copy of the cache is ever made.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"
#include "vec_math.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the CPU paged-attention kernel needs AVX2 and FMA"
#endif

#define TILE 16
#define DIM_LANES_MAX_ROWS 7   /* tiles of fewer query rows put the head dimension in the lanes */

typedef __m256 v8;

#define ld _mm256_loadu_ps
#define st _mm256_storeu_ps
#define bcast _mm256_set1_ps
#define fmadd _mm256_fmadd_ps

/* exp(x) for x <= 0 on 8 lanes; exactly 0 below -87 and for -inf. */
static inline v8 exp_nonpos(v8 x) {
    const v8 low = bcast(-87.0f);
    return _mm256_andnot_ps(_mm256_cmp_ps(x, low, _CMP_LT_OQ), exp_clamped(_mm256_max_ps(x, low)));
}

/* The query-lanes path's vectors: LANES query rows each, 16 where the build has AVX-512 (its
 * 32 registers also take wider score and value tiles), else 8. Each lane does its row's
 * arithmetic of the header whatever the width, so the width changes the speed only. */
#if defined(__AVX512F__)
typedef __m512 vec;
typedef __m512i ivec;
#define LANES 16
#define QK_KEYS 6   /* keys per score tile (2 query vectors, 2 chains: 24 accumulators) */
#define ND_MAX 12   /* value columns per value tile (2 query vectors) */
#define vld _mm512_loadu_ps
#define vst _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vfma _mm512_fmadd_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vmax _mm512_max_ps
#define vzero _mm512_setzero_ps
#define ild(p) _mm512_loadu_si512((const void *)(p))
#define iset1 _mm512_set1_epi32
#define isub _mm512_sub_epi32
#define vsoftcap softcap16

static inline vec vexp_nonpos(vec x) {
    const vec low = vset1(-87.0f);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_NLT_UQ),
                               exp_clamped16(_mm512_max_ps(x, low)));
}

/* m, with -inf replaced by 0 (the softmax's shift z) */
static inline vec zero_if_ninf(vec m) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, vset1(-INFINITY), _CMP_NEQ_UQ), m);
}

/* s in the lanes whose key j is in range (from <= j < hi), -inf in the others */
static inline vec keep_in_range(vec s, ivec from, ivec hi, int32_t j) {
    const ivec jj = iset1(j);
    const __mmask16 in = _kandn_mask16(_mm512_cmpgt_epi32_mask(from, jj),
                                       _mm512_cmpgt_epi32_mask(hi, jj));
    return _mm512_mask_blend_ps(in, vset1(-INFINITY), s);
}
#else
typedef __m256 vec;
typedef __m256i ivec;
#define LANES 8
#define QK_KEYS 3
#define ND_MAX 6
#define vld _mm256_loadu_ps
#define vst _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vfma _mm256_fmadd_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vmax _mm256_max_ps
#define vzero _mm256_setzero_ps
#define ild(p) _mm256_loadu_si256((const __m256i *)(p))
#define iset1 _mm256_set1_epi32
#define isub _mm256_sub_epi32

#define vexp_nonpos exp_nonpos
#define vsoftcap softcap8

static inline vec zero_if_ninf(vec m) {
    return _mm256_andnot_ps(_mm256_cmp_ps(m, vset1(-INFINITY), _CMP_EQ_OQ), m);
}

static inline vec keep_in_range(vec s, ivec from, ivec hi, int32_t j) {
    const ivec jj = iset1(j);
    const ivec in = _mm256_andnot_si256(_mm256_cmpgt_epi32(from, jj), _mm256_cmpgt_epi32(hi, jj));
    return _mm256_blendv_ps(vset1(-INFINITY), s, _mm256_castsi256_ps(in));
}
#endif

static inline float hmax(v8 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline void load_rows(float *dst, const void *src, int64_t offset, int64_t n, int bf16) {
    if (!bf16) {
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src + offset;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) st(dst + i, load_bf16x8(s + i));
    for (; i < n; i++) {
        uint32_t u = (uint32_t)s[i] << 16;
        memcpy(dst + i, &u, 4);
    }
}

/* n K or V rows from pool row `row` of `cache` into dst (n x D floats): float32 copied,
 * bfloat16 widened, int8 dequantized (float(q) * scale, the scale after each row's D values). */
static void load_kv(float *dst, const attn_args *a, const void *cache, int64_t row, int64_t n) {
    const int64_t D = a->D;
    if (!a->kv_int8) {
        load_rows(dst, cache, row * D, n * D, a->bf16);
        return;
    }
    const int64_t width = D + (int64_t)sizeof(float);
    const int8_t *r = (const int8_t *)cache + row * width;
    for (int64_t j = 0; j < n; j++, r += width) {
        float scale;
        memcpy(&scale, r + D, sizeof(scale));
        const v8 s = bcast(scale);
        for (int64_t d = 0; d < D; d += 8) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r + d)));
            st(dst + j * D + d, _mm256_mul_ps(_mm256_cvtepi32_ps(q), s));
        }
    }
}

static inline float exp1(float x) { return _mm256_cvtss_f32(exp_nonpos(bcast(x))); }

/* The keys [first, valid) of block p that a query at `pos` attending from `lo` reads. */
static inline void block_range(int64_t pos, int64_t lo, int64_t p, int64_t B, int64_t *first,
                               int64_t *valid) {
    int64_t v = pos - p * B + 1, f = lo - p * B;
    v = v < 0 ? 0 : v < B ? v : B;
    f = f < 0 ? 0 : f;
    *first = f;
    *valid = f >= v ? 0 : v;
}

/* ---- query rows in the lanes (tiles of 8 or more rows) ---------------------------------- */

/* The width of the next of the fewest tiles of at most `widest` keys or columns that cover
 * `left`, the tiles as even as they go (64 columns in tiles of 12: 11 x 4 + 10 x 2, not
 * 12 x 5 + 4): every tile keeps most of its accumulators busy. Which tile a key or column is in changes no arithmetic. */
static inline int64_t balanced_width(int64_t left, int64_t widest) {
    const int64_t tiles = (left + widest - 1) / widest;
    return (left + tiles - 1) / tiles;
}

/* acc[h][g][j] = the header's partial chains p_c (h = 0) and p_{c+1} (h = 1) of query vector g
 * and key j < NK of k: two chains at a time, so each is added to its neighbour in registers.
 * `D` is a constant where the caller knows it (64), so the NK keys' broadcasts are one pointer
 * plus fixed offsets and the loop unrolls. */
static inline __attribute__((always_inline)) void qk_chains(
        const float *qT, int64_t NQP, int64_t i0, const float *k, const int64_t D, int c,
        vec acc[2][2][QK_KEYS], const int QV, const int NK) {
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < QV; g++)
            for (int j = 0; j < NK; j++) acc[h][g][j] = vzero();
    for (int64_t d = c; d < D; d += 8) {
        vec qv[2][2];
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < QV; g++) qv[h][g] = vld(qT + (d + h) * NQP + i0 + LANES * g);
        for (int j = 0; j < NK; j++)
            for (int h = 0; h < 2; h++) {
                const vec kv = vset1(k[j * D + d + h]);
                for (int g = 0; g < QV; g++) acc[h][g][j] = vfma(qv[h][g], kv, acc[h][g][j]);
            }
    }
}

/* sT[j][i0..] = scale * (q . k_j) for keys j < NK of k (rows of D floats), QV vectors of LANES
 * query rows, each dot product as the header's 8 partial chains and their tree. Two chains at a
 * time hold the registers (2 * QV * NK accumulators, the query vectors and a broadcast) and are
 * summed as they finish; the pairs' sums wait in `part` (L1) between them, in the header's
 * order: t0 = p0 + p1; t0 = t0 + (p2 + p3); t1 = p4 + p5; score = t0 + (t1 + (p6 + p7)). With
 * `mx`, also the scores' running maximum over the keys (for blocks no row masks). */
static inline __attribute__((always_inline)) void qk_tile(
        const float *qT, int64_t NQP, int64_t i0, const float *k, const int64_t D, float *sT,
        vec scale, const float *cap, float *mx, const int QV, const int NK) {
    float part[2][2][QK_KEYS][LANES] __attribute__((aligned(64)));
    vec p[2][2][QK_KEYS];
#define EACH for (int g = 0; g < QV; g++) for (int j = 0; j < NK; j++)
#define PART(t) (&part[t][g][j][0])
#define PAIR vadd(p[0][g][j], p[1][g][j])
    for (int c = 0; c < 8; c += 2) {
        qk_chains(qT, NQP, i0, k, D, c, p, QV, NK);
        switch (c) {
        case 0: EACH vst(PART(0), PAIR); break;
        case 2: EACH vst(PART(0), vadd(vld(PART(0)), PAIR)); break;
        case 4: EACH vst(PART(1), PAIR); break;
        default:
            EACH {
                vec x = vmul(vadd(vld(PART(0)), vadd(vld(PART(1)), PAIR)), scale);
                if (cap) x = vsoftcap(x, vset1(*cap));
                p[0][g][j] = x;
            }
        }
    }
#undef PAIR
#undef PART
#undef EACH
    for (int g = 0; g < QV; g++) {
        vec m = mx ? vld(mx + i0 + LANES * g) : vzero();
        for (int j = 0; j < NK; j++) {
            vst(sT + j * NQP + i0 + LANES * g, p[0][g][j]);
            if (mx) m = vmax(m, p[0][g][j]);
        }
        if (mx) vst(mx + i0 + LANES * g, m);
    }
}

#define QK_CASE(qv, nk) \
    case (qv) * 16 + (nk): qk_tile(qT, NQP, i0, k, D, sT + j0 * NQP, scale, cap, mx, qv, nk); break;

/* The scaled scores of the n keys of block kb; with `mx`, their running row maxima too. */
static inline __attribute__((always_inline)) void qk_lanes_d(
        const float *qT, int64_t NQP, const float *kb, const int64_t D, int64_t n, float *sT,
        vec scale, const float *cap, float *mx) {
    for (int64_t i0 = 0; i0 < NQP; i0 += 2 * LANES) {
        const int qv = NQP - i0 >= 2 * LANES ? 2 : 1;
        for (int64_t j0 = 0, nk; j0 < n; j0 += nk) {
            nk = balanced_width(n - j0, QK_KEYS);
            const float *k = kb + j0 * D;
            switch (qv * 16 + nk) {
                QK_CASE(1, 1) QK_CASE(1, 2) QK_CASE(1, 3) QK_CASE(2, 1) QK_CASE(2, 2) QK_CASE(2, 3)
#if QK_KEYS > 3
                QK_CASE(1, 4) QK_CASE(1, 5) QK_CASE(1, 6) QK_CASE(2, 4) QK_CASE(2, 5) QK_CASE(2, 6)
#endif
            }
        }
    }
}

/* qk_lanes_d, with the head dimension a constant where it is 64 (the same arithmetic). */
static void qk_lanes(const float *qT, int64_t NQP, const float *kb, int64_t D, int64_t n, float *sT,
                     vec scale, const float *cap, float *mx) {
    if (D == 64) qk_lanes_d(qT, NQP, kb, 64, n, sT, scale, cap, mx);
    else qk_lanes_d(qT, NQP, kb, D, n, sT, scale, cap, mx);
}

/* accT[d][i0..] = accT * alpha, then + sum_{j < n} wT[j][i0..] * v[j][d], for columns
 * d0..d0+ND and QV vectors of LANES query rows. */
static inline __attribute__((always_inline)) void pv_tile(
        float *accT, const float *alpha, const float *wT, int64_t NQP, int64_t i0,
        const float *vb, int64_t D, int64_t n, int64_t d0, const int QV, const int ND) {
    vec acc[2][ND_MAX];
    for (int g = 0; g < QV; g++) {
        const vec al = vld(alpha + i0 + LANES * g);
        for (int c = 0; c < ND; c++)
            acc[g][c] = vmul(vld(accT + (d0 + c) * NQP + i0 + LANES * g), al);
    }
    for (int64_t j = 0; j < n; j++) {
        vec w[2];
        for (int g = 0; g < QV; g++) w[g] = vld(wT + j * NQP + i0 + LANES * g);
        for (int c = 0; c < ND; c++) {
            const vec vv = vset1(vb[j * D + d0 + c]);
            for (int g = 0; g < QV; g++) acc[g][c] = vfma(w[g], vv, acc[g][c]);
        }
    }
    for (int g = 0; g < QV; g++)
        for (int c = 0; c < ND; c++) vst(accT + (d0 + c) * NQP + i0 + LANES * g, acc[g][c]);
}

#define PV_CASE(qv, nd) \
    case (qv) * 16 + (nd): pv_tile(accT, alpha, wT, NQP, i0, vb, D, n, d0, qv, nd); break;

static void pv_lanes(float *accT, const float *alpha, const float *wT, int64_t NQP,
                     const float *vb, int64_t D, int64_t n) {
    for (int64_t i0 = 0; i0 < NQP; i0 += 2 * LANES) {
        const int qv = NQP - i0 >= 2 * LANES ? 2 : 1;
        for (int64_t d0 = 0, nd; d0 < D; d0 += nd) {
            nd = balanced_width(D - d0, ND_MAX);
            switch (qv * 16 + nd) {
                PV_CASE(1, 1) PV_CASE(1, 2) PV_CASE(1, 3) PV_CASE(1, 4) PV_CASE(1, 5) PV_CASE(1, 6)
                PV_CASE(2, 1) PV_CASE(2, 2) PV_CASE(2, 3) PV_CASE(2, 4) PV_CASE(2, 5) PV_CASE(2, 6)
#if ND_MAX > 6
                PV_CASE(1, 7) PV_CASE(1, 8) PV_CASE(1, 9) PV_CASE(1, 10) PV_CASE(1, 11) PV_CASE(1, 12)
                PV_CASE(2, 7) PV_CASE(2, 8) PV_CASE(2, 9) PV_CASE(2, 10) PV_CASE(2, 11) PV_CASE(2, 12)
#endif
            }
        }
    }
}

static void attend_query_lanes(const attn_args *a, int64_t t0, int64_t nt, int64_t kvh) {
    const int64_t D = a->D, B = a->B, G = a->H / a->KVH, NQ = nt * G;
    const int64_t NQP = (NQ + LANES - 1) / LANES * LANES;
    float qT[D][NQP], accT[D][NQP], sT[B][NQP], row[D];
    float m[NQP], mnew[NQP], l[NQP], alpha[NQP];
    int32_t pos[NQP], lo[NQP];   /* a row attends to keys [lo, pos]; padding rows: none */
    const int convert = a->bf16 || a->kv_int8;   /* K/V read through the tiles below */
    float kconv[convert ? B : 1][D], vconv[convert ? B : 1][D];
    int64_t max_pos = 0, min_lo = INT64_MAX, min_pos = NQ < NQP ? -1 : INT64_MAX, max_lo = 0;
    memset(qT, 0, sizeof(qT));
    memset(accT, 0, sizeof(accT));
    for (int64_t i = 0; i < NQP; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        pos[i] = -1;
        lo[i] = 0;
        if (i >= NQ) continue;
        const int64_t t = t0 + i / G, h = kvh * G + i % G;
        if (a->sinks) {
            m[i] = a->sinks[h];
            l[i] = 1.0f;
        }
        load_rows(row, a->q, (t * a->H + h) * D, D, a->bf16);
        for (int64_t d = 0; d < D; d++) qT[d][i] = row[d];
        pos[i] = a->q_pos[t];
        lo[i] = a->window > 0 && pos[i] - a->window + 1 > 0 ? pos[i] - a->window + 1 : 0;
        if (pos[i] > max_pos) max_pos = pos[i];
        if (pos[i] < min_pos) min_pos = pos[i];
        if (lo[i] < min_lo) min_lo = lo[i];
        if (lo[i] > max_lo) max_lo = lo[i];
    }
    const int32_t *table = a->tables + (int64_t)a->q_seq[t0] * a->max_blocks;
    const vec scale = vset1(a->scale), zero = vzero();
    for (int64_t p = min_lo / B; p * B <= max_pos; p++) {
        const int64_t row = kvh * a->S + (int64_t)table[p] * B, base = row * D;
        const int64_t n = max_pos - p * B + 1 < B ? max_pos - p * B + 1 : B;  /* keys read */
        const float *kb = (const float *)a->k_cache + base, *vb = (const float *)a->v_cache + base;
        if (convert) {
            load_kv(&kconv[0][0], a, a->k_cache, row, n);
            load_kv(&vconv[0][0], a, a->v_cache, row, n);
            kb = &kconv[0][0];
            vb = &vconv[0][0];
        }
        /* A block every row reads whole needs no mask: the scores come scaled, with maxima. */
        const int whole = n == B && min_pos >= p * B + B - 1 && max_lo <= p * B;
        if (whole) memcpy(mnew, m, sizeof(m));
        qk_lanes(&qT[0][0], NQP, kb, D, n, &sT[0][0], scale, a->softcap ? &a->softcap : NULL,
                 whole ? mnew : NULL);
        for (int64_t i0 = 0; i0 < NQP; i0 += LANES) {
            const vec m_old = vld(m + i0);
            vec mx = m_old;
            if (whole) {
                mx = vld(mnew + i0);
            } else {   /* key j is in range: from <= j < hi */
                const ivec hi = isub(ild(pos + i0), iset1((int)(p * B - 1)));
                const ivec from = isub(ild(lo + i0), iset1((int)(p * B)));
                for (int64_t j = 0; j < n; j++) {
                    const vec x = keep_in_range(vld(sT[j] + i0), from, hi, (int32_t)j);
                    vst(sT[j] + i0, x);
                    mx = vmax(mx, x);
                }
            }
            const vec z = zero_if_ninf(mx);
            vec sum = zero;
            for (int64_t j = 0; j < n; j++) {
                const vec w = vexp_nonpos(vsub(vld(sT[j] + i0), z));
                vst(sT[j] + i0, w);
                sum = vadd(sum, w);
            }
            const vec al = vexp_nonpos(vsub(m_old, z));
            vst(alpha + i0, al);
            vst(l + i0, vfma(vld(l + i0), al, sum));
            vst(m + i0, mx);
        }
        pv_lanes(&accT[0][0], alpha, &sT[0][0], NQP, vb, D, n);
    }
    for (int64_t i = 0; i < NQ; i++) {
        const int64_t t = t0 + i / G, h = kvh * G + i % G;
        const float inv = 1.0f / l[i];
        float *o = a->out + (t * a->H + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = accT[d][i] * inv;
    }
}

/* ---- the head dimension in the lanes (tiles of fewer than 8 rows: decodes) ---------------- */

/* s[r * stride + j0 + j] = the scores of query rows r < R (q: rows of D floats) against the 4 keys
 * at k (rows of D floats), j < 4: the head dimension in the lanes, so lane c of a key's
 * accumulator is the header's partial chain p_c; three hadds and one add take the 4 keys' trees
 * at once. With AVX-512 two keys share a vector (one per 8-lane half, each half the same chains),
 * and the halves are split before the same hadds. */
static inline __attribute__((always_inline)) void qk_dims_tile(
        const float *q, int64_t D, const float *k, float *s, int64_t stride, int64_t j0,
        const int R) {
    v8 acc[2][4];
#if defined(__AVX512F__)
    __m512 pairs[2][2];   /* keys (0 | 1) and (2 | 3) */
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 2; j++) pairs[r][j] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m512 kv[2];
        for (int j = 0; j < 2; j++)
            kv[j] = _mm512_insertf32x8(_mm512_castps256_ps512(ld(k + 2 * j * D + d0)),
                                       ld(k + (2 * j + 1) * D + d0), 1);
        for (int r = 0; r < R; r++) {
            const __m512 qv = _mm512_broadcast_f32x8(ld(q + r * D + d0));
            for (int j = 0; j < 2; j++) pairs[r][j] = _mm512_fmadd_ps(qv, kv[j], pairs[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 2; j++) {
            acc[r][2 * j] = _mm512_castps512_ps256(pairs[r][j]);
            acc[r][2 * j + 1] = _mm512_extractf32x8_ps(pairs[r][j], 1);
        }
#else
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
        v8 kv[4];
        for (int j = 0; j < 4; j++) kv[j] = ld(k + j * D + d0);
        for (int r = 0; r < R; r++) {
            const v8 qv = ld(q + r * D + d0);
            for (int j = 0; j < 4; j++) acc[r][j] = fmadd(qv, kv[j], acc[r][j]);
        }
    }
#endif
    for (int r = 0; r < R; r++) {
        /* lanes (k0: p01, p23, k1: p01, p23 | k0: p45, p67, k1: p45, p67), then the 4 keys'
         * (p01 + p23) in the low half and (p45 + p67) in the high */
        const v8 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),
                                    _mm256_hadd_ps(acc[r][2], acc[r][3]));
        _mm_storeu_ps(s + r * stride + j0,
                      _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

/* The scores of the NQ query rows against the n keys at kb (rows of D floats, read in place),
 * 4 keys at a time, into s (row r at s + r * stride); a last group of fewer than 4 keys is
 * padded with zero rows in `pad` (4 x D), its extra scores written up to the next multiple of 4
 * and never read. */
static void qk_dims(const float *q, int64_t NQ, int64_t D, const float *kb, int64_t n, float *s,
                    int64_t stride, float *pad) {
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
        const float *k = kb + j0 * D;
        if (n - j0 < 4) {
            memset(pad, 0, (size_t)(4 * D) * sizeof(float));
            memcpy(pad, k, (size_t)((n - j0) * D) * sizeof(float));
            k = pad;
        }
        int64_t r = 0;
        for (; r + 2 <= NQ; r += 2) qk_dims_tile(q + r * D, D, k, s + r * stride, stride, j0, 2);
        if (r < NQ) qk_dims_tile(q + r * D, D, k, s + r * stride, stride, j0, 1);
    }
}

/* acc[c0 + c] = acc[c0 + c] * alpha, then + sum_{j < n} w[j] * v[j][c0 + c], for LANES * DG
 * columns: the columns in the lanes, DG independent chains. */
static inline __attribute__((always_inline)) void pv_row_tile(
        float *acc, float alpha, const float *w, const float *vb, int64_t D, int64_t n,
        int64_t c0, const int DG) {
    vec o[8];
    for (int g = 0; g < DG; g++) o[g] = vmul(vld(acc + c0 + LANES * g), vset1(alpha));
    for (int64_t j = 0; j < n; j++) {
        const vec wj = vset1(w[j]);
        for (int g = 0; g < DG; g++) o[g] = vfma(wj, vld(vb + j * D + c0 + LANES * g), o[g]);
    }
    for (int g = 0; g < DG; g++) vst(acc + c0 + LANES * g, o[g]);
}

#define PV_ROW_CASE(dg) case dg: pv_row_tile(acc, alpha, w, vb, D, n, c0, dg); break;

static void pv_row(float *acc, float alpha, const float *w, const float *vb, int64_t D, int64_t n) {
    int64_t c0 = 0;
    for (; c0 + LANES <= D; c0 += 8 * LANES) {
        switch ((D - c0) / LANES < 8 ? (int)((D - c0) / LANES) : 8) {
            PV_ROW_CASE(1) PV_ROW_CASE(2) PV_ROW_CASE(3) PV_ROW_CASE(4)
            PV_ROW_CASE(5) PV_ROW_CASE(6) PV_ROW_CASE(7) PV_ROW_CASE(8)
        }
    }
#if LANES > 8
    c0 = D / LANES * LANES;
    if (c0 < D) {   /* the last 8 columns of a head dimension that is an odd multiple of 8 */
        v8 o = _mm256_mul_ps(ld(acc + c0), bcast(alpha));
        for (int64_t j = 0; j < n; j++) o = fmadd(bcast(w[j]), ld(vb + j * D + c0), o);
        st(acc + c0, o);
    }
#endif
}

static void attend_dim_lanes(const attn_args *a, int64_t t0, int64_t nt, int64_t kvh) {
    const int64_t D = a->D, B = a->B, G = a->H / a->KVH, NQ = nt * G;
    const int64_t BP = (B + 15) / 16 * 16;
    float q[NQ][D], acc[NQ][D], m[NQ], l[NQ];
    const int convert = a->bf16 || a->kv_int8;
    float kconv[convert ? B : 1][D], vconv[convert ? B : 1][D], pad[4][D];
    int64_t pos[NQ], lo[NQ];
    int64_t max_pos = 0, min_lo = INT64_MAX;
    for (int64_t i = 0; i < NQ; i++) {
        const int64_t t = t0 + i / G, h = kvh * G + i % G;
        load_rows(q[i], a->q, (t * a->H + h) * D, D, a->bf16);
        for (int64_t d = 0; d < D; d++) acc[i][d] = 0.0f;
        m[i] = a->sinks ? a->sinks[h] : -INFINITY;
        l[i] = a->sinks ? 1.0f : 0.0f;
        pos[i] = a->q_pos[t];
        lo[i] = a->window > 0 && pos[i] - a->window + 1 > 0 ? pos[i] - a->window + 1 : 0;
        if (pos[i] > max_pos) max_pos = pos[i];
        if (lo[i] < min_lo) min_lo = lo[i];
    }
    const int32_t *table = a->tables + (int64_t)a->q_seq[t0] * a->max_blocks;
    const v8 scale = bcast(a->scale), ninf = bcast(-INFINITY);
    const int64_t p0 = min_lo / B, blocks = max_pos / B + 1 - p0;
    /* Two sweeps, each one long stream through memory: every block's scores first (K), then
     * block by block the online-softmax update and the values (V), in the same order and with
     * the same arithmetic as the query-lanes path. s[i] holds row i's scores of all blocks. */
    float *scores = (float *)malloc((size_t)(NQ * blocks * BP) * sizeof(float));
    if (!scores) abort();   /* a few KiB per decode: out of memory is fatal anyway */
    const int64_t ss = blocks * BP;   /* row stride of scores */
    for (int64_t p = p0; p * B <= max_pos; p++) {
        const int64_t row = kvh * a->S + (int64_t)table[p] * B;
        const int64_t n = max_pos - p * B + 1 < B ? max_pos - p * B + 1 : B;
        const float *kb = (const float *)a->k_cache + row * D;
        if (convert) {
            load_kv(&kconv[0][0], a, a->k_cache, row, n);
            kb = &kconv[0][0];
        }
        qk_dims(&q[0][0], NQ, D, kb, n, scores + (p - p0) * BP, ss, &pad[0][0]);
    }
    for (int64_t p = p0; p * B <= max_pos; p++) {
        const int64_t row = kvh * a->S + (int64_t)table[p] * B;
        const float *vb = (const float *)a->v_cache + row * D;
        if (convert) {
            const int64_t n = max_pos - p * B + 1 < B ? max_pos - p * B + 1 : B;
            load_kv(&vconv[0][0], a, a->v_cache, row, n);
            vb = &vconv[0][0];
        }
        for (int64_t i = 0; i < NQ; i++) {
            int64_t first, valid;
            block_range(pos[i], lo[i], p, B, &first, &valid);
            if (!valid) continue;
            float *s = scores + i * ss + (p - p0) * BP;
            v8 mx = bcast(m[i]);
            for (int64_t j0 = 0; j0 < valid; j0 += 8) {
                const __m256i jj = _mm256_add_epi32(_mm256_set1_epi32((int)j0),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                const __m256i in = _mm256_andnot_si256(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32((int)first), jj),
                    _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), jj));
                v8 x = _mm256_mul_ps(ld(s + j0), scale);
                if (a->softcap) x = softcap8(x, bcast(a->softcap));
                x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(in));
                st(s + j0, x);
                mx = _mm256_max_ps(mx, x);
            }
            const float m_new = hmax(mx), z = m_new == -INFINITY ? 0.0f : m_new;
            const v8 vz = bcast(z);
            float sum = 0.0f;
            for (int64_t j0 = 0; j0 < valid; j0 += 8) {
                st(s + j0, exp_nonpos(_mm256_sub_ps(ld(s + j0), vz)));
                for (int64_t j = j0; j < valid && j < j0 + 8; j++) sum += s[j];
            }
            const float al = exp1(m[i] - z);
            l[i] = fmaf(l[i], al, sum);
            m[i] = m_new;
            pv_row(acc[i], al, s, vb, D, valid);
        }
    }
    free(scores);
    for (int64_t i = 0; i < NQ; i++) {
        const int64_t t = t0 + i / G, h = kvh * G + i % G;
        const v8 inv = bcast(1.0f / l[i]);
        float *o = a->out + (t * a->H + h) * D;
        for (int64_t d0 = 0; d0 < D; d0 += 8) st(o + d0, _mm256_mul_ps(ld(acc[i] + d0), inv));
    }
}

/* tile_start: (num_tiles + 1,) first token of each tile (tiles never cross sequences). Items
 * run kv-head-major: the threads work on neighbouring tiles of one head at a time, so a long
 * context's blocks come from DRAM once and the other tiles find them in cache. */
void rtpkv_paged_attention(const attn_args *a, const int64_t *tile_start, int64_t num_tiles) {
    const int64_t items = num_tiles * a->KVH, G = a->H / a->KVH;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; w++) {
        const int64_t kvh = w / num_tiles, tile = w % num_tiles;
        const int64_t t0 = tile_start[tile], nt = tile_start[tile + 1] - t0;
        if (nt * G <= DIM_LANES_MAX_ROWS)
            attend_dim_lanes(a, t0, nt, kvh);
        else
            attend_query_lanes(a, t0, nt, kvh);
    }
}

int64_t rtpkv_tile_limit(void) { return TILE; }

/* Query rows per vector of the prefill path (the ISA level this library was built for). */
int64_t rtpkv_attention_lanes(void) { return LANES; }

/* The kernel computes in groups of 8 columns. */
int64_t rtpkv_head_dim_multiple(void) { return 8; }
