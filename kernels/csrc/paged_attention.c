/* Paged attention on the CPU, reading K/V blocks in place from the head-major pool.
 *
 * Every query token attends to positions [0, pos] of its sequence, block by block in position
 * order, with an online softmax. The arithmetic done for one query depends only on that query,
 * its position and the cached K/V it reads: not on how many other tokens share the batch, nor on
 * where its prefill chunk starts, nor on the thread that runs it. That makes prefix reuse,
 * chunked prefill and batching bit-exact (the batch-invariance guarantee of rtpkv).
 *
 * Work items are (tile of up to TILE consecutive tokens of one sequence, kv head); the query
 * heads of a GQA group share each block read while it is in L1.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 16

typedef struct {
    const void *q;          /* (T, H, D) float32 or bfloat16 */
    const void *k_cache;    /* (KVH, S, D) */
    const void *v_cache;
    float *out;             /* (T, H, D) float32 */
    const int32_t *q_seq;   /* (T,) row of the token's sequence in tables */
    const int32_t *q_pos;   /* (T,) position of the token: it attends to [0, pos] */
    const int32_t *tables;  /* (num_seqs, max_blocks) block ids */
    int64_t max_blocks, T, H, KVH, D, B, S;
    float scale;
    int bf16;
} attn_args;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* exp(x) for x <= 0 (Cephes polynomial, ~1 ulp); exactly 0 below -87 and for -inf. Plain
 * arithmetic, so the vectorised and the scalar code give the same bits. */
static inline float exp_nonpos(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return x < -87.0f ? 0.0f : p * two_n;
}

typedef float v8 __attribute__((vector_size(32)));

static inline void load_row(float *dst, const void *src, int64_t offset, int64_t D, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(s[d]);
    } else {
        memcpy(dst, (const float *)src + offset, (size_t)D * sizeof(float));
    }
}

static inline v8 ld(const float *p) { v8 x; memcpy(&x, p, sizeof(x)); return x; }
static inline void st(float *p, v8 x) { memcpy(p, &x, sizeof(x)); }

/* Scores of query rows qa and qb against the 8 * KG keys of kt (D x BP, transposed), KG <= 4.
 * Each score is a sum over d in order: the same bits whichever rows are paired. */
static inline void scores2(const float *qa, const float *qb, const float *kt, int64_t D,
                           int64_t BP, int64_t g0, int64_t KG, float *sa, float *sb) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int64_t d = 0; d < D; d++) {
        const float *k = kt + d * BP + g0 * 8;
        const v8 x = {qa[d], qa[d], qa[d], qa[d], qa[d], qa[d], qa[d], qa[d]};
        const v8 y = {qb[d], qb[d], qb[d], qb[d], qb[d], qb[d], qb[d], qb[d]};
        v8 k0 = ld(k);
        a0 += x * k0; b0 += y * k0;
        if (KG > 1) { v8 k1 = ld(k + 8); a1 += x * k1; b1 += y * k1; }
        if (KG > 2) { v8 k2 = ld(k + 16); a2 += x * k2; b2 += y * k2; }
        if (KG > 3) { v8 k3 = ld(k + 24); a3 += x * k3; b3 += y * k3; }
    }
    st(sa + g0 * 8, a0); st(sb + g0 * 8, b0);
    if (KG > 1) { st(sa + g0 * 8 + 8, a1); st(sb + g0 * 8 + 8, b1); }
    if (KG > 2) { st(sa + g0 * 8 + 16, a2); st(sb + g0 * 8 + 16, b2); }
    if (KG > 3) { st(sa + g0 * 8 + 24, a3); st(sb + g0 * 8 + 24, b3); }
}

/* acc[d] = acc[d] * alpha + sum_j w[j] * v[j][d] over j < n, in order of j, for 8 * DG
 * columns starting at column c0 (DG <= 4), for two query rows at once. */
static inline void values2(float *acc_a, float *acc_b, float alpha_a, float alpha_b,
                           const float *wa, const float *wb, const float *vb, int64_t D,
                           int64_t n, int64_t c0, int64_t DG) {
    v8 a[4], b[4];
    for (int64_t g = 0; g < DG; g++) {
        a[g] = ld(acc_a + c0 + 8 * g) * alpha_a;
        b[g] = ld(acc_b + c0 + 8 * g) * alpha_b;
    }
    for (int64_t j = 0; j < n; j++) {
        const v8 x = {wa[j], wa[j], wa[j], wa[j], wa[j], wa[j], wa[j], wa[j]};
        const v8 y = {wb[j], wb[j], wb[j], wb[j], wb[j], wb[j], wb[j], wb[j]};
        const float *v = vb + j * D + c0;
        for (int64_t g = 0; g < DG; g++) {
            v8 vv = ld(v + 8 * g);
            a[g] += x * vv;
            b[g] += y * vv;
        }
    }
    for (int64_t g = 0; g < DG; g++) {
        st(acc_a + c0 + 8 * g, a[g]);
        st(acc_b + c0 + 8 * g, b[g]);
    }
}

/* One query row's online-softmax update from its raw scores s[0..BP): masks keys >= valid,
 * turns s into weights, returns the rescale factor of the old accumulator. */
static inline float softmax_step(float *s, int64_t BP, int64_t valid, float scale, float *m,
                                 float *l) {
    float mx = *m;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < BP; j++) {
        s[j] = j < valid ? s[j] * scale : -INFINITY;
        mx = s[j] > mx ? s[j] : mx;
    }
    float alpha = exp_nonpos(*m - mx), sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < BP; j++) {
        s[j] = exp_nonpos(s[j] - mx);
        sum += s[j];
    }
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}

static void attend_tile(const attn_args *a, int64_t t0, int64_t nt, int64_t kvh) {
    const int64_t D = a->D, B = a->B, G = a->H / a->KVH, NQ = nt * G;
    const int64_t BP = (B + 7) / 8 * 8, NQP = NQ + (NQ & 1);
    float q[NQP][D], acc[NQP][D], m[NQP], l[NQP], s[NQP][BP], row[D];
    float kt[D][BP], vb[B][D];   /* keys transposed: scores vectorise over keys */
    int64_t pos[NQP];
    int64_t max_pos = 0;
    memset(kt, 0, sizeof(kt));
    memset(q, 0, sizeof(q));
    for (int64_t i = 0; i < NQP; i++) {
        for (int64_t d = 0; d < D; d++) acc[i][d] = 0.0f;
        m[i] = -INFINITY;
        l[i] = 0.0f;
        pos[i] = -1;               /* the padding row (odd NQ) attends to nothing */
        if (i >= NQ) continue;
        int64_t t = t0 + i / G, h = kvh * G + i % G;
        load_row(q[i], a->q, (t * a->H + h) * D, D, a->bf16);
        pos[i] = a->q_pos[t];
        if (pos[i] > max_pos) max_pos = pos[i];
    }
    const int32_t *table = a->tables + (int64_t)a->q_seq[t0] * a->max_blocks;
    for (int64_t p = 0; p * B <= max_pos; p++) {
        int64_t base = (kvh * a->S + (int64_t)table[p] * B) * D;
        int64_t rows = max_pos - p * B + 1 < B ? max_pos - p * B + 1 : B;
        for (int64_t j = 0; j < rows; j++) {
            load_row(row, a->k_cache, base + j * D, D, a->bf16);
            for (int64_t d = 0; d < D; d++) kt[d][j] = row[d];
            load_row(vb[j], a->v_cache, base + j * D, D, a->bf16);
        }
        for (int64_t i = 0; i < NQP; i += 2) {
            if (p * B > pos[i] && p * B > pos[i + 1]) continue;
            for (int64_t g = 0; g < BP / 8; g += 4)
                scores2(q[i], q[i + 1], &kt[0][0], D, BP, g, BP / 8 - g < 4 ? BP / 8 - g : 4,
                        s[i], s[i + 1]);
            float alpha[2];
            int64_t n[2];
            for (int64_t r = 0; r < 2; r++) {
                int64_t valid = pos[i + r] - p * B + 1;
                valid = valid < 0 ? 0 : valid < B ? valid : B;
                n[r] = valid;
                alpha[r] = valid ? softmax_step(s[i + r], BP, valid, a->scale, &m[i + r], &l[i + r])
                                 : 1.0f;
                if (!valid) for (int64_t j = 0; j < BP; j++) s[i + r][j] = 0.0f;
            }
            int64_t nmax = n[0] > n[1] ? n[0] : n[1];
            for (int64_t c = 0; c < D; c += 32)
                values2(acc[i], acc[i + 1], alpha[0], alpha[1], s[i], s[i + 1], &vb[0][0], D,
                        nmax, c, (D - c) / 8 < 4 ? (D - c) / 8 : 4);
        }
    }
    for (int64_t i = 0; i < NQ; i++) {
        int64_t t = t0 + i / G, h = kvh * G + i % G;
        float inv = 1.0f / l[i];
        float *o = a->out + (t * a->H + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = acc[i][d] * inv;
    }
}

/* tile_start: (num_tiles + 1,) first token of each tile (tiles never cross sequences). */
void rtpkv_paged_attention(const attn_args *a, const int64_t *tile_start, int64_t num_tiles) {
    const int64_t items = num_tiles * a->KVH;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; w++) {
        int64_t tile = w / a->KVH, kvh = w % a->KVH;
        attend_tile(a, tile_start[tile], tile_start[tile + 1] - tile_start[tile], kvh);
    }
}

int64_t rtpkv_tile_limit(void) { return TILE; }
