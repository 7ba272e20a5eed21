/* A mixture-of-experts layer in one call (kernels/moe_experts.py): the router, the routing, the
 * chosen experts and the shared expert, so a decode step makes no Python call between a
 * layer's attention and its next one (the fused decoder, csrc/decoder.c, calls this too).
 *
 * Routing, row by row as transformers computes it: the router's logits (the float32 kernel of
 * fp32_linear.c), a float32 softmax, the top_k largest probabilities (ties to the lower expert
 * index, torch.topk's choice), optionally renormalised to sum to 1. The float32 softmax's
 * exp and sum are libm's and sequential, so a weight can differ from torch's in its last bit:
 * the same experts, the same output within float32 rounding (tests/model/test_moe.py).
 *
 * Experts: for each expert in ascending order, its tokens' rows gathered, the gate_up
 * projection, SiLU-and-mul, the down projection, each output row scaled by its routing weight
 * and added onto that token's row of `out` (zeroed here). A token's experts are thus added in
 * ascending expert order, onto zeros, each as one multiply then one add: the per-layer torch
 * loop's order (model_factory/moe.py), on the kernels its linear layers run (fp32_linear.c with
 * its bf16-weight variant, int8_linear.c, w8a8_linear.c, fused_ops.c), so a token's output
 * depends on its own row only, whatever else shares the call. Then Qwen2-MoE's shared expert:
 * out + sigmoid(gate(x)) * shared(x), the sigmoid in double, rounded to float32.
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

/* Row t's experts and weights (top_k each) from its router logits (num_experts). */
static void route_row(const moe_layer *m, const float *logits, float *probs, int64_t *experts,
                      float *weights) {
    const int64_t NE = m->num_experts, K = m->top_k;
    float top = logits[0];
    for (int64_t e = 1; e < NE; e++)
        if (logits[e] > top) top = logits[e];
    float sum = 0.0f;
    for (int64_t e = 0; e < NE; e++) {
        probs[e] = expf(logits[e] - top);
        sum += probs[e];
    }
    for (int64_t e = 0; e < NE; e++) probs[e] = probs[e] / sum;
    float chosen = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < NE; e++)
            if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
        experts[k] = best;
        weights[k] = probs[best];
        chosen += probs[best];
        probs[best] = -1.0f;   /* taken */
    }
    if (m->normalize)
        for (int64_t k = 0; k < K; k++) weights[k] = weights[k] / chosen;
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

/* A gated MLP (gate_up, SiLU-and-mul, down) of `inter` over n rows of xs into y; `work` holds
 * n * 3 * inter floats. */
static void expert(const moe_layer *m, const expert_layer *l, int64_t inter, const float *xs,
                   int64_t n, float *work, float *y) {
    float *gate_up = work, *act = work + n * 2 * inter;
    linear(m, &l->gate_up, xs, n, m->hidden, 2 * inter, gate_up);
    rtpkv_silu_and_mul(gate_up, act, n, inter, 0);
    linear(m, &l->down, act, n, inter, m->hidden, y);
}

void rtpkv_moe_forward(const moe_layer *m, const float *x, int64_t T, float *out) {
    const int64_t E = m->hidden, I = m->inter, NE = m->num_experts, K = m->top_k;
    const int64_t pairs = T * K;
    float *logits = checked_malloc((size_t)(T * NE + NE + 2 * pairs) * sizeof(float));
    float *probs = logits + T * NE, *weights = probs + NE, *pair_weights = weights + pairs;
    int64_t *ints = checked_malloc((size_t)(2 * pairs + 2 * NE) * sizeof(int64_t));
    int64_t *experts = ints, *pair_tokens = ints + pairs, *counts = ints + 2 * pairs,
            *fill = counts + NE;

    rtpkv_fp32_linear(x, T, E, m->router, NE, NULL, logits);
    for (int64_t t = 0; t < T; t++)
        route_row(m, logits + t * NE, probs, experts + t * K, weights + t * K);

    /* the (token, weight) pairs grouped by expert, tokens ascending within an expert */
    memset(counts, 0, (size_t)NE * sizeof(int64_t));
    for (int64_t i = 0; i < pairs; i++) counts[experts[i]]++;
    int64_t widest = 0;
    for (int64_t e = 0, start = 0; e < NE; e++) {
        fill[e] = start;
        start += counts[e];
        if (counts[e] > widest) widest = counts[e];
    }
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t at = fill[experts[i]]++;
        pair_tokens[at] = i / K;
        pair_weights[at] = weights[i];
    }

    const int64_t SI = m->shared_inter, rows = widest > T ? widest : T;
    const int64_t widest_inter = SI > I ? SI : I;
    float *xs = checked_malloc((size_t)(rows * (2 * E + 3 * widest_inter) + T) * sizeof(float));
    float *y = xs + rows * E, *work = y + rows * E, *gate = work + rows * 3 * widest_inter;
    memset(out, 0, (size_t)(T * E) * sizeof(float));
    for (int64_t e = 0, start = 0; e < NE; e++) {
        const int64_t n = counts[e];
        if (!n) continue;
        for (int64_t r = 0; r < n; r++)
            memcpy(xs + r * E, x + pair_tokens[start + r] * E, (size_t)E * sizeof(float));
        expert(m, &m->experts[e], I, xs, n, work, y);
        add_scaled(out, y, pair_tokens + start, pair_weights + start, n, E);
        start += n;
    }
    if (SI) {
        expert(m, &m->shared, SI, x, T, work, y);
        linear(m, &m->shared_gate, x, T, E, 1, gate);
        for (int64_t t = 0; t < T; t++) {
            const double v = gate[t];
            const float g = (float)(v >= 0 ? 1.0 / (1.0 + exp(-v)) : exp(v) / (1.0 + exp(v)));
            for (int64_t j = 0; j < E; j++) {
                const float scaled = g * y[t * E + j];
                out[t * E + j] = out[t * E + j] + scaled;
            }
        }
    }
    free(xs);
    free(ints);
    free(logits);
}
