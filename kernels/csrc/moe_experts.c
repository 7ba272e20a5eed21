/* A mixture-of-experts layer in one call (kernels/moe_experts.py): the router, the routing, the
 * chosen experts and the shared expert, so a decode step makes no Python call between a
 * layer's attention and its next one (the fused decoder, csrc/decoder.c, calls this too).
 *
 * Routing, row by row as transformers computes it: the router's logits (the float32 kernel of
 * fp32_linear.c, with gpt-oss's bias), a float32 softmax, the top_k largest probabilities (ties
 * to the lower expert index, torch.topk's choice), optionally renormalised to sum to 1; or, for
 * gpt-oss and Granite, the top_k largest logits, then their softmax. The float32 softmax's
 * exp and sum are libm's and sequential, so a weight can differ from torch's in its last bit:
 * the same experts, the same output within float32 rounding (tests/model/test_moe.py).
 *
 * Experts: the (token, weight) pairs grouped by expert, their rows gathered; each expert's
 * gate_up projection, SiLU-and-mul (or gpt-oss's clamped SwiGLU) and down projection, with their
 * biases where they have them, over its rows (all experts' gate_up in
 * one parallel region, then all their down projections, on every weight type's kernel); then each
 * output row scaled by its routing weight and added onto its token's row of `out` (zeroed
 * here), experts in ascending order. A token's experts are thus added in
 * ascending expert order, onto zeros, each as one multiply then one add: the per-layer torch
 * loop's order (model_factory/moe.py), on the kernels its linear layers run (fp32_linear.c with
 * its bf16-weight variant, int8_linear.c, w8a8_linear.c, fused_ops.c), so a token's output
 * depends on its own row only, whatever else shares the call. Then Qwen2-MoE's shared expert:
 * out + sigmoid(gate(x)) * shared(x), the sigmoid in double, rounded to float32; Granite's,
 * ungated: out + shared(x).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static void *checked_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) abort();
    return p;
}

static inline void linear(const moe_layer *m, const linear_layer *l, const float *x, int64_t T,
                          int64_t K, int64_t N, float *y) {
    rtpkv_linear(m->linear_kind, l, x, T, K, N, y, m->int8_group, m->panel_rows);
}

/* Row t's experts and weights (top_k each) from its router logits (num_experts): the top_k
 * largest probabilities of a softmax over every expert, optionally renormalised; or
 * (softmax_after_top_k) a softmax over the top_k largest logits. Ties go to the lower expert
 * index (torch.topk's choice). */
static void route_row(const moe_layer *m, const float *logits, float *probs, int64_t *chosen,
                      float *weights) {
    const int64_t NE = m->num_experts, K = m->top_k;
    if (m->softmax_after_top_k) {
        for (int64_t e = 0; e < NE; e++) probs[e] = 0.0f;   /* 1: taken */
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < NE; e++)
                if (probs[e] == 0.0f && (best < 0 || logits[e] > logits[best])) best = e;
            chosen[k] = best;
            weights[k] = logits[best];
            probs[best] = 1.0f;
        }
        const float top = weights[0];   /* the largest */
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            weights[k] = expf(weights[k] - top);
            sum += weights[k];
        }
        for (int64_t k = 0; k < K; k++) weights[k] = weights[k] / sum;
        return;
    }
    float top = logits[0];
    for (int64_t e = 1; e < NE; e++)
        if (logits[e] > top) top = logits[e];
    float sum = 0.0f;
    for (int64_t e = 0; e < NE; e++) {
        probs[e] = expf(logits[e] - top);
        sum += probs[e];
    }
    for (int64_t e = 0; e < NE; e++) probs[e] = probs[e] / sum;
    float sum_chosen = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < NE; e++)
            if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
        chosen[k] = best;
        weights[k] = probs[best];
        sum_chosen += probs[best];
        probs[best] = -1.0f;   /* taken */
    }
    if (m->normalize)
        for (int64_t k = 0; k < K; k++) weights[k] = weights[k] / sum_chosen;
}

/* out[rows] += each row of y scaled by its weight: one multiply, then one add. */
static void add_scaled(float *out, const float *y, const int64_t *rows, const float *weights,
                       int64_t n, int64_t E) {
    for (int64_t r = 0; r < n; r++) {
        float *row = out + rows[r] * E;
        const float w = weights[r];
        for (int64_t j = 0; j < E; j++) {
            const float scaled = y[r * E + j] * w;
            row[j] = row[j] + scaled;
        }
    }
}

/* The experts' activation over n rows of gate_up (gate then up, inter each) into act: SiLU(gate)
 * * up, or gpt-oss's clamped SwiGLU (fused_ops.c, the kernels of the torch path's MLPs). */
static void activate(const moe_layer *m, const float *gate_up, float *act, int64_t n,
                     int64_t inter) {
    if (m->activation == MOE_CLAMPED_SWIGLU)
        rtpkv_clamped_swiglu(gate_up, act, n, inter, m->alpha, m->limit, 0);
    else
        rtpkv_silu_and_mul(gate_up, act, n, inter, 0);
}

/* A gated MLP (gate_up, SiLU-and-mul, down) of `inter` over n rows of xs into y, through
 * gate_up (n * 2 * inter floats) and act (n * inter): the shared expert, always SwiGLU. */
static void expert(const moe_layer *m, const expert_layer *l, int64_t inter, const float *xs,
                   int64_t n, float *gate_up, float *act, float *y) {
    linear(m, &l->gate_up, xs, n, m->hidden, 2 * inter, gate_up);
    rtpkv_silu_and_mul(gate_up, act, n, inter, 0);
    linear(m, &l->down, act, n, inter, m->hidden, y);
}

/* y[r] = y[r] + bias over n rows of N: every linear kernel adds its bias to a finished sum as
 * one float addition (fp32_linear.c's tile, vec_math.h's store_lanes), so this gives the bits
 * of a call with the bias; the _many kernels take none. */
static void add_bias(float *y, int64_t n, int64_t N, const float *bias) {
    if (!bias) return;
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < N; j++) y[r * N + j] = y[r * N + j] + bias[j];
}

/* `count` of the experts' linear layers of one shape (K inputs, N outputs), layer i over x[i]
 * (rows[i] rows) into y[i], in one parallel region on the layers' kernel (each kernel's _many
 * function: the same outputs as one call per layer). */
static void linear_many(const moe_layer *m, int64_t count, const float **x, const int64_t *rows,
                        int64_t K, const void **w, const float **scale, int64_t N, float **y) {
    switch (m->linear_kind) {
    case LINEAR_INT8:
        rtpkv_int8_linear_many(count, x, rows, K, (const int8_t *const *)w, scale, N,
                               m->int8_group, y, m->panel_rows);
        break;
    case LINEAR_W8A8:
        rtpkv_w8a8_linear_many(count, x, rows, K, (const int8_t *const *)w, scale, N, y,
                               m->panel_rows);
        break;
    default:
        rtpkv_linear_many(count, x, rows, K, w, N, y, m->linear_kind == LINEAR_BF16);
    }
}

/* The chosen experts over the pairs' rows xs (grouped by expert: counts[e] rows from expert
 * e's start), into y: all experts' gate_up projections in one parallel region, SiLU-and-mul
 * in one, their down projections in one, on every weight type's kernel. */
static void experts(const moe_layer *m, const int64_t *counts, const float *xs, int64_t pairs,
                    float *gate_up, float *act, float *y) {
    const int64_t E = m->hidden, I = m->inter, NE = m->num_experts;
    const float **x = checked_malloc((size_t)NE * (3 * sizeof(float *) + sizeof(void *) +
                                                   sizeof(int64_t)));
    const float **scale = x + NE;
    float **out = (float **)(scale + NE);
    const void **w = (const void **)(out + NE);
    int64_t *rows = (int64_t *)(w + NE), used = 0;
    for (int64_t e = 0, start = 0; e < NE; start += counts[e], e++) {
        if (!counts[e]) continue;
        x[used] = xs + start * E;
        rows[used] = counts[e];
        w[used] = m->experts[e].gate_up.weight;
        scale[used] = m->experts[e].gate_up.scale;
        out[used++] = gate_up + start * 2 * I;
    }
    linear_many(m, used, x, rows, E, w, scale, 2 * I, out);
    for (int64_t e = 0, start = 0; e < NE; start += counts[e], e++)
        add_bias(gate_up + start * 2 * I, counts[e], 2 * I, m->experts[e].gate_up.bias);
    activate(m, gate_up, act, pairs, I);
    used = 0;
    for (int64_t e = 0, start = 0; e < NE; start += counts[e], e++) {
        if (!counts[e]) continue;
        x[used] = act + start * I;
        w[used] = m->experts[e].down.weight;
        scale[used] = m->experts[e].down.scale;
        out[used++] = y + start * E;
    }
    linear_many(m, used, x, rows, I, w, scale, E, out);
    for (int64_t e = 0, start = 0; e < NE; start += counts[e], e++)
        add_bias(y + start * E, counts[e], E, m->experts[e].down.bias);
    free(x);
}

void rtpkv_moe_forward(const moe_layer *m, const float *x, int64_t T, float *out) {
    const int64_t E = m->hidden, I = m->inter, NE = m->num_experts, K = m->top_k;
    const int64_t pairs = T * K;
    float *logits = checked_malloc((size_t)(T * NE + NE + 2 * pairs) * sizeof(float));
    float *probs = logits + T * NE, *weights = probs + NE, *pair_weights = weights + pairs;
    int64_t *ints = checked_malloc((size_t)(2 * pairs + 2 * NE) * sizeof(int64_t));
    int64_t *chosen = ints, *pair_tokens = ints + pairs, *counts = ints + 2 * pairs,
            *fill = counts + NE;

    rtpkv_fp32_linear(x, T, E, m->router, NE, m->router_bias, logits);
    for (int64_t t = 0; t < T; t++)
        route_row(m, logits + t * NE, probs, chosen + t * K, weights + t * K);

    /* the (token, weight) pairs grouped by expert, tokens ascending within an expert */
    memset(counts, 0, (size_t)NE * sizeof(int64_t));
    for (int64_t i = 0; i < pairs; i++) counts[chosen[i]]++;
    for (int64_t e = 0, start = 0; e < NE; e++) {
        fill[e] = start;
        start += counts[e];
    }
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t at = fill[chosen[i]]++;
        pair_tokens[at] = i / K;
        pair_weights[at] = weights[i];
    }

    float *xs = checked_malloc((size_t)(pairs * (2 * E + 3 * I)) * sizeof(float));
    float *y = xs + pairs * E, *gate_up = y + pairs * E, *act = gate_up + pairs * 2 * I;
    for (int64_t i = 0; i < pairs; i++)
        memcpy(xs + i * E, x + pair_tokens[i] * E, (size_t)E * sizeof(float));
    experts(m, counts, xs, pairs, gate_up, act, y);
    memset(out, 0, (size_t)(T * E) * sizeof(float));
    add_scaled(out, y, pair_tokens, pair_weights, pairs, E);   /* experts in ascending order */
    free(xs);

    const int64_t SI = m->shared_inter;
    if (SI) {
        float *shared = checked_malloc((size_t)(T * (E + 3 * SI + 1)) * sizeof(float));
        float *ys = shared, *gate = ys + T * E, *work = gate + T;
        expert(m, &m->shared, SI, x, T, work, work + T * 2 * SI, ys);
        if (m->shared_gate.weight) linear(m, &m->shared_gate, x, T, E, 1, gate);
        for (int64_t t = 0; t < T; t++) {
            float g = 1.0f;   /* ungated (Granite's): 1 * ys is ys exactly */
            if (m->shared_gate.weight) {
                const double v = gate[t];
                g = (float)(v >= 0 ? 1.0 / (1.0 + exp(-v)) : exp(v) / (1.0 + exp(v)));
            }
            for (int64_t j = 0; j < E; j++) {
                const float scaled = g * ys[t * E + j];
                out[t * E + j] = out[t * E + j] + scaled;
            }
        }
        free(shared);
    }
    free(ints);
    free(logits);
}
