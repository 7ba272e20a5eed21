/* A mixture-of-experts layer's experts in one call (kernels/moe_experts.py): for each expert in
 * ascending order, its tokens' rows gathered, the gate_up projection, SiLU-and-mul, the down
 * projection, each output row scaled by its routing weight and added onto that token's row of
 * `out` (zeros from the caller). A token's experts are thus added in ascending expert order,
 * onto zeros, each as one multiply then one add: what the per-layer path does in torch
 * (model_factory/moe.py), with the same kernels on the same rows (fused_ops.c, fp32_linear.c
 * with its bf16-weight variant, int8_linear.c, w8a8_linear.c, linked into this library), so
 * the two give the same bits and a token's output depends on its own row only. What it removes
 * is the Python around each expert's four kernels, which in a one-token decode step costs more
 * than they do.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    linear_layer gate_up, down;
} expert_layer;

typedef struct {                   /* a layer's experts, fixed at load */
    int64_t num_experts, hidden, inter;
    int64_t linear_kind;           /* LINEAR_*: the kernel of every expert's linear layers */
    int64_t int8_group;            /* LINEAR_INT8's group size */
    int64_t panel_rows;            /* the fewest rows the int8 kernels' prefill tiles take */
    const expert_layer *experts;   /* (num_experts,) */
} moe_experts;


static inline void linear(const moe_experts *m, const linear_layer *l, const float *x,
                          int64_t T, int64_t K, int64_t N, float *y) {
    rtpkv_linear(m->linear_kind, l, x, T, K, N, y, m->int8_group, m->panel_rows);
}

/* x: (T, hidden); counts: (num_experts,) tokens per expert; tokens, weights: the (token,
 * weight) pairs grouped by expert in ascending order; out: (T, hidden) zeros; scratch: at least
 * max(counts) * (2 * hidden + 3 * inter) floats. */
void rtpkv_moe_experts(const moe_experts *m, const float *x, const int64_t *counts,
                       const int64_t *tokens, const float *weights, float *out, float *scratch) {
    const int64_t E = m->hidden, I = m->inter;
    int64_t start = 0;
    for (int64_t e = 0; e < m->num_experts; e++) {
        const int64_t n = counts[e];
        if (!n) continue;
        float *xs = scratch, *gate_up = xs + n * E, *act = gate_up + n * 2 * I, *y = act + n * I;
        for (int64_t r = 0; r < n; r++)
            memcpy(xs + r * E, x + tokens[start + r] * E, (size_t)E * sizeof(float));
        linear(m, &m->experts[e].gate_up, xs, n, E, 2 * I, gate_up);
        rtpkv_silu_and_mul(gate_up, act, n, I, 0);
        linear(m, &m->experts[e].down, act, n, I, E, y);
        for (int64_t r = 0; r < n; r++) {
            float *row = out + tokens[start + r] * E;
            const float w = weights[start + r];
            for (int64_t j = 0; j < E; j++) {
                const float scaled = y[r * E + j] * w;
                row[j] = row[j] + scaled;
            }
        }
        start += n;
    }
}
