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

#define TILE 8

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

static inline void load_row(float *dst, const void *src, int64_t offset, int64_t D, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(s[d]);
    } else {
        memcpy(dst, (const float *)src + offset, (size_t)D * sizeof(float));
    }
}

static void attend_tile(const attn_args *a, int64_t t0, int64_t nt, int64_t kvh) {
    const int64_t D = a->D, B = a->B, G = a->H / a->KVH, NQ = nt * G;
    float q[NQ][D], acc[NQ][D], m[NQ], l[NQ], s[B];
    float kb[B][D], vb[B][D];
    int64_t pos[NQ];
    int64_t max_pos = 0;
    for (int64_t i = 0; i < NQ; i++) {
        int64_t t = t0 + i / G, h = kvh * G + i % G;
        load_row(q[i], a->q, (t * a->H + h) * D, D, a->bf16);
        for (int64_t d = 0; d < D; d++) acc[i][d] = 0.0f;
        m[i] = -INFINITY;
        l[i] = 0.0f;
        pos[i] = a->q_pos[t];
        if (pos[i] > max_pos) max_pos = pos[i];
    }
    const int32_t *table = a->tables + (int64_t)a->q_seq[t0] * a->max_blocks;
    for (int64_t p = 0; p * B <= max_pos; p++) {
        int64_t base = (kvh * a->S + (int64_t)table[p] * B) * D;
        int64_t rows = max_pos - p * B + 1 < B ? max_pos - p * B + 1 : B;
        for (int64_t j = 0; j < rows; j++) {
            load_row(kb[j], a->k_cache, base + j * D, D, a->bf16);
            load_row(vb[j], a->v_cache, base + j * D, D, a->bf16);
        }
        for (int64_t i = 0; i < NQ; i++) {
            if (p * B > pos[i]) continue;
            int64_t valid = pos[i] - p * B + 1 < B ? pos[i] - p * B + 1 : B;
            float mx = m[i];
            for (int64_t j = 0; j < B; j++) {
                float dot = 0.0f;
                if (j < valid) {
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += q[i][d] * kb[j][d];
                    dot *= a->scale;
                } else {
                    dot = -INFINITY;
                }
                s[j] = dot;
                mx = dot > mx ? dot : mx;
            }
            float alpha = exp_nonpos(m[i] - mx), sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < B; j++) {
                s[j] = exp_nonpos(s[j] - mx);
                sum += s[j];
            }
            l[i] = l[i] * alpha + sum;
            m[i] = mx;
            for (int64_t d = 0; d < D; d++) acc[i][d] *= alpha;
            for (int64_t j = 0; j < valid; j++) {
                const float w = s[j];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[i][d] += w * vb[j][d];
            }
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
