/* A forward's decoder layers in one call (kernels/fused_decoder.py): the token embeddings
 * (scaled, Gemma), then for each layer RMSNorm with the residual add, the qkv projection, the
 * q/k heads' norms (Qwen3, Gemma 3), RoPE on the layer's table, the KV write, paged attention
 * over the layer's window and block tables, the output projection, RMSNorm (Gemma's sandwich:
 * the attention output's norm, then the MLP input's), and gate_up, SiLU- or GELU-and-mul and
 * the down projection (Gemma: normalized), or a sparse layer's mixture of experts
 * (moe_experts.c); then the final norm and the LM head on the rows that sample, soft-capped
 * (Gemma 2, whose attention scores the paged kernel soft-caps too). Gemma's (1 + w)
 * norms are the same RMSNorm over a float32 weight that already holds 1 + w.
 *
 * It calls the very kernels the per-layer path calls from Python (fused_ops.c, fp32_linear.c,
 * int8_linear.c, w8a8_linear.c, paged_attention.c, moe_experts.c, linked into this library),
 * in the same order on the same values, so its results are bit-identical to that path's: what
 * it removes is the Python between them, which in a one-token decode step costs more than the
 * small kernels it calls (docs/BENCHMARKS.md, "Single-stream decode").
 *
 * `rtpkv_decoder_generate` runs several greedy decode steps of a batch in one call (the
 * engine's NUM_SCHEDULER_STEPS): each step is that same forward, its arg-max tokens the next
 * step's ids, the positions and KV write rows advanced in between, so every token and every
 * K/V row comes out as the steps one call at a time would give them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"
#include "paged_attention.h"

typedef struct {                   /* one decoder layer, fixed at load */
    const float *input_norm, *post_norm;
    const float *pre_ff_norm;      /* Gemma's sandwich: post_norm normalizes the attention
                                      output, this the MLP input, post_ff_norm the MLP output;
                                      NULL: Llama's two norms (post_norm is the MLP input's) */
    const float *post_ff_norm;
    const float *q_norm, *k_norm;  /* the RMSNorm of each q and k head before RoPE (Qwen3, Gemma
                                      3); NULL: none */
    const float *cos, *sin;        /* the layer's RoPE table, (max_positions, head_dim) */
    float scale;                   /* the softmax scale */
    float softcap;                 /* the attention scores' soft-cap (Gemma 2); 0: none */
    int64_t gelu;                  /* the dense MLP's activation: GELU (tanh), else SiLU */
    linear_layer qkv, o, gate_up, down;
    const moe_layer *moe;          /* a sparse layer's mixture of experts (moe_experts.c), in
                                      place of gate_up and down; NULL: the dense MLP */
    void *k_cache, *v_cache;       /* the layer's pool: (KVH * S, D) floats, or int8 rows of
                                      D values and a float32 scale (attn.kv_int8) */
    const float *sinks;            /* (heads,) attention sinks (gpt-oss); NULL: none */
} decoder_layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter;
    float eps;
    int64_t linear_kind;           /* LINEAR_*: the kernel of every linear layer */
    int64_t int8_group;            /* LINEAR_INT8's group size (LINEAR_W8A8's is fixed) */
    int64_t panel_rows;            /* the fewest rows the int8 kernels' prefill tiles take */
    float embedding_scale;         /* the embeddings are multiplied by it (Gemma); 0: not */
    float final_softcap;           /* logits become cap * tanh(logit / cap) (Gemma 2); 0: not */
    const float *final_norm;
    const float *embedding;        /* (vocab, hidden) */
    linear_layer lm_head;          /* hidden -> vocab, on the layers' kernel */
    int64_t vocab;
} decoder_model;

typedef struct {                   /* a layer's view of the batch (a CpuMetadata): its KV cache
                                      group's block tables, its window, the pool rows it writes */
    const int32_t *q_seq;          /* (T,) */
    int32_t *q_pos;                /* (T,) */
    const int32_t *tables;         /* (num_seqs, max_blocks) */
    int64_t max_blocks;
    int64_t *write_rows;           /* (KVH, T) */
    int64_t window;                /* 0: none */
} attn_view;

typedef struct {                   /* one forward */
    int64_t T;
    const int64_t *ids;            /* (T,) token ids whose embeddings start the residual stream,
                                      each below vocab; NULL: `residual` holds them already */
    float *residual;               /* (T, hidden): the residual stream */
    float *out;                    /* (T, hidden): the final norm of the residual stream */
    int64_t num_logits;            /* rows of `out` the LM head projects (0: none) */
    const int64_t *logit_rows;     /* (num_logits,) which, in order */
    float *logits;                 /* (num_logits, vocab) */
    const int64_t *positions;      /* (T,) */
    attn_args attn;                /* the shared fields; the view's, q, caches, out and scale
                                      are set per layer */
    const attn_view *views;        /* (num_views,) the distinct views of the batch */
    int64_t num_views;
    const int64_t *layer_view;     /* (layers,) each layer's index into views */
    const int64_t *tile_start;
    int64_t num_tiles;
    const decoder_layer *layer;    /* the layers over this step's KV pool (per call: the pool can
                                      be another one, at another address, at the next call) */
    float *x, *qkv, *q, *att, *h, *gate_up, *act;   /* scratch, T rows each */
    double *seconds;               /* NULL, or sums of wall seconds, added to per SECONDS_* part */
} decoder_step;

typedef struct {                   /* several decode steps of one row per sequence */
    int64_t steps;                 /* steps to run at most */
    int64_t *tokens;               /* (steps, T) each step's arg-max token of each row */
    int64_t *ids;                  /* (T,) the step's ids: the decoder_step's, advanced here */
    int64_t *positions;            /* (T,) its positions, advanced here, and each view's q_pos
                                      and write rows with them */
    const int64_t *stop_start;     /* (T + 1,) row r stops at a token in */
    const int64_t *stop_ids;       /*   stop_ids[stop_start[r] .. stop_start[r + 1]) */
} decoder_burst;

enum { SECONDS_LINEAR, SECONDS_ATTENTION, SECONDS_ELEMENTWISE };   /* benchmarks/decode_step.py */

static inline double clock_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Charges the time since *last to `part` when the step is timed. */
static inline void lap(decoder_step *s, int part, double *last) {
    if (!s->seconds) return;
    const double now = clock_now();
    s->seconds[part] += now - *last;
    *last = now;
}

static inline void linear(const decoder_model *m, const linear_layer *l, const float *x,
                          int64_t T, int64_t K, int64_t N, float *y) {
    rtpkv_linear(m->linear_kind, l, x, T, K, N, y, m->int8_group, m->panel_rows);
}

/* The new tokens' K and V (rows of the qkv output) into the pool, q into its own rows; into an
 * int8 pool by the quantized write the per-layer path calls (fused_ops.c). A prefill's rows are
 * copied by every thread (each row to its own places). */
static void scatter_qkv(const decoder_model *m, const decoder_layer *l, const attn_view *v,
                        decoder_step *s) {
    const int64_t D = m->head_dim, KVH = m->kv_heads, T = s->T;
    const int64_t q_size = m->heads * D, kv_size = KVH * D, width = q_size + 2 * kv_size;
    if (s->attn.kv_int8)
        rtpkv_write_kv_int8(s->qkv + q_size, s->qkv + q_size + kv_size, l->k_cache, l->v_cache,
                            v->write_rows, T, KVH, D, width, width, 0);
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *row = s->qkv + t * width;
        memcpy(s->q + t * q_size, row, (size_t)q_size * sizeof(float));
        if (s->attn.kv_int8) continue;
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t dst = v->write_rows[h * T + t] * D;
            memcpy((float *)l->k_cache + dst, row + q_size + h * D, (size_t)D * sizeof(float));
            memcpy((float *)l->v_cache + dst, row + q_size + kv_size + h * D,
                   (size_t)D * sizeof(float));
        }
    }
}

void rtpkv_decoder_forward(const decoder_model *m, decoder_step *s) {
    const int64_t T = s->T, E = m->hidden, D = m->head_dim, I = m->inter;
    const int64_t q_size = m->heads * D, width = q_size + 2 * m->kv_heads * D;
    double t = s->seconds ? clock_now() : 0.0;
    if (s->ids)
        for (int64_t r = 0; r < T; r++) {
            const float *row = m->embedding + s->ids[r] * E;
            float *dst = s->residual + r * E;
            if (m->embedding_scale == 0.0f)
                memcpy(dst, row, (size_t)E * sizeof(float));
            else   /* one rounding per value, as torch's multiply by a float32 scalar */
                for (int64_t e = 0; e < E; e++) dst[e] = row[e] * m->embedding_scale;
        }
    for (int64_t i = 0; i < m->layers; i++) {
        const decoder_layer *l = &s->layer[i];
        const attn_view *v = &s->views[s->layer_view[i]];
        rtpkv_rms_norm(i == 0 ? s->residual : s->h, i == 0 ? NULL : s->residual, l->input_norm,
                       s->x, T, E, m->eps, 0);
        lap(s, SECONDS_ELEMENTWISE, &t);
        linear(m, &l->qkv, s->x, T, E, width, s->qkv);
        lap(s, SECONDS_LINEAR, &t);
        if (l->q_norm) {
            rtpkv_head_norm(s->qkv, T, width, m->heads, D, l->q_norm, m->eps);
            rtpkv_head_norm(s->qkv + q_size, T, width, m->kv_heads, D, l->k_norm, m->eps);
        }
        rtpkv_rope(s->qkv, s->qkv + q_size, T, m->heads, m->kv_heads, width, width, D, l->cos,
                   l->sin, s->positions, 0);
        lap(s, SECONDS_ELEMENTWISE, &t);
        scatter_qkv(m, l, v, s);
        s->attn.q_seq = v->q_seq;
        s->attn.q_pos = v->q_pos;
        s->attn.tables = v->tables;
        s->attn.max_blocks = v->max_blocks;
        s->attn.window = v->window;
        s->attn.scale = l->scale;
        s->attn.softcap = l->softcap;
        s->attn.sinks = l->sinks;
        s->attn.q = s->q;
        s->attn.k_cache = l->k_cache;
        s->attn.v_cache = l->v_cache;
        s->attn.out = s->att;
        rtpkv_paged_attention(&s->attn, s->tile_start, s->num_tiles);
        lap(s, SECONDS_ATTENTION, &t);
        linear(m, &l->o, s->att, T, q_size, E, s->h);
        lap(s, SECONDS_LINEAR, &t);
        if (l->pre_ff_norm) {   /* the norm's rows are read whole before written: in place */
            rtpkv_rms_norm(s->h, NULL, l->post_norm, s->h, T, E, m->eps, 0);
            rtpkv_rms_norm(s->h, s->residual, l->pre_ff_norm, s->x, T, E, m->eps, 0);
        } else {
            rtpkv_rms_norm(s->h, s->residual, l->post_norm, s->x, T, E, m->eps, 0);
        }
        lap(s, SECONDS_ELEMENTWISE, &t);
        if (l->moe) {   /* router, routing and experts: mostly the experts' GEMVs */
            rtpkv_moe_forward(l->moe, s->x, T, s->h);
            lap(s, SECONDS_LINEAR, &t);
        } else {
            linear(m, &l->gate_up, s->x, T, E, 2 * I, s->gate_up);
            lap(s, SECONDS_LINEAR, &t);
            if (l->gelu)
                rtpkv_gelu_tanh_and_mul(s->gate_up, s->act, T, I, 0);
            else
                rtpkv_silu_and_mul(s->gate_up, s->act, T, I, 0);
            lap(s, SECONDS_ELEMENTWISE, &t);
            linear(m, &l->down, s->act, T, I, E, s->h);
            lap(s, SECONDS_LINEAR, &t);
        }
        if (l->post_ff_norm) {
            rtpkv_rms_norm(s->h, NULL, l->post_ff_norm, s->h, T, E, m->eps, 0);
            lap(s, SECONDS_ELEMENTWISE, &t);
        }
    }
    rtpkv_rms_norm(s->h, s->residual, m->final_norm, s->out, T, E, m->eps, 0);
    lap(s, SECONDS_ELEMENTWISE, &t);
    if (s->num_logits <= 0) return;
    for (int64_t r = 0; r < s->num_logits; r++)   /* the rows that sample, gathered */
        memcpy(s->x + r * E, s->out + s->logit_rows[r] * E, (size_t)E * sizeof(float));
    linear(m, &m->lm_head, s->x, s->num_logits, E, m->vocab, s->logits);
    if (m->final_softcap != 0.0f) rtpkv_softcap(s->logits, s->num_logits * m->vocab,
                                                m->final_softcap);
    lap(s, SECONDS_LINEAR, &t);
}

/* Up to b->steps decode steps of the T rows of `s` (one token per sequence, `s->logits` of T
 * rows, logit_rows 0..T-1, the block tables covering every position the steps reach). Stops
 * early once every row has produced one of its stop tokens. Returns the steps run. */
int64_t rtpkv_decoder_generate(const decoder_model *m, decoder_step *s, const decoder_burst *b) {
    const int64_t T = s->T, KVH = m->kv_heads, B = s->attn.B, S = s->attn.S;
    char *stopped = calloc((size_t)T, 1);
    if (!stopped) abort();
    int64_t step = 0, left = T;
    while (step < b->steps && left > 0) {
        if (step > 0)
            for (int64_t r = 0; r < T; r++) {
                const int64_t pos = ++b->positions[r];
                b->ids[r] = b->tokens[(step - 1) * T + r];
                for (int64_t i = 0; i < s->num_views; i++) {   /* each group's own tables */
                    const attn_view *v = &s->views[i];
                    v->q_pos[r] = (int32_t)pos;
                    const int64_t slot = (int64_t)v->tables[(int64_t)v->q_seq[r] * v->max_blocks
                                                            + pos / B] * B + pos % B;
                    for (int64_t h = 0; h < KVH; h++) v->write_rows[h * T + r] = h * S + slot;
                }
            }
        rtpkv_decoder_forward(m, s);
        int64_t *tokens = b->tokens + step * T;
        rtpkv_argmax(s->logits, T, m->vocab, tokens);
        for (int64_t r = 0; r < T; r++) {
            if (stopped[r]) continue;
            for (int64_t i = b->stop_start[r]; i < b->stop_start[r + 1]; i++)
                if (tokens[r] == b->stop_ids[i]) {
                    stopped[r] = 1;
                    left--;
                    break;
                }
        }
        step++;
    }
    free(stopped);
    return step;
}
