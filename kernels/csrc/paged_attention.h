/* The paged-attention kernel's arguments (csrc/paged_attention.c; mirrored by _Args in
 * kernels/cpu_attention.py), shared with the decoder driver (csrc/decoder.c). */
#ifndef RTPKV_PAGED_ATTENTION_H
#define RTPKV_PAGED_ATTENTION_H

#include <stdint.h>

typedef struct {
    const void *q;          /* (T, H, D) float32 or bfloat16 */
    const void *k_cache;    /* (KVH, S, D); int8: (KVH, S, D + 4 bytes of scale) */
    const void *v_cache;
    float *out;             /* (T, H, D) float32 */
    const int32_t *q_seq;   /* (T,) row of the token's sequence in tables */
    const int32_t *q_pos;   /* (T,) position of the token: it attends to [0, pos] */
    const int32_t *tables;  /* (num_seqs, max_blocks) block ids */
    int64_t max_blocks, T, H, KVH, D, B, S;
    float scale;
    int bf16;
    int64_t window;         /* tokens attended per query, itself included; 0: no window */
    int kv_int8;            /* K/V are int8 rows with their scale; else of q's dtype */
    const float *sinks;     /* (H,) a logit per query head in every softmax's denominator
                             * (attention sinks, gpt-oss); NULL: none */
    float softcap;          /* scores become softcap * tanh(score / softcap) (Gemma 2); 0: not */
} attn_args;

void rtpkv_paged_attention(const attn_args *a, const int64_t *tile_start, int64_t num_tiles);

#endif
