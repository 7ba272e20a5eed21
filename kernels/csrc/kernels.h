/* The C kernels that csrc/decoder.c and csrc/moe_experts.c call, declared once: each kernel's source includes this
 * header too, so the compiler checks its definition against what the decoder calls (the Python
 * bindings in kernels/ declare their own ctypes signatures). */
#ifndef RTPKV_KERNELS_H
#define RTPKV_KERNELS_H

#include <stdint.h>
#include <stdlib.h>

/* fused_ops.c */
void rtpkv_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                    int64_t dim, float eps, int bf16);
void rtpkv_head_norm(float *x, int64_t T, int64_t stride, int64_t heads, int64_t dim,
                     const float *weight, float eps);
void rtpkv_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int bf16);
void rtpkv_gelu_tanh_and_mul(const void *gate_up, void *out, int64_t rows, int64_t inter,
                             int bf16);
void rtpkv_clamped_swiglu(const void *gate_up, void *out, int64_t rows, int64_t inter,
                          float alpha, float limit, int bf16);
void rtpkv_rope(void *q, void *k, int64_t tokens, int64_t q_heads, int64_t k_heads,
                int64_t q_stride, int64_t k_stride, int64_t dim, const void *cos, const void *sin,
                const int64_t *positions, int bf16);
void rtpkv_argmax(const float *x, int64_t rows, int64_t cols, int64_t *out);
void rtpkv_softcap(float *x, int64_t n, float cap);
void rtpkv_write_kv_int8(const void *k, const void *v, int8_t *k_cache, int8_t *v_cache,
                         const int64_t *rows, int64_t T, int64_t KVH, int64_t D, int64_t k_stride,
                         int64_t v_stride, int bf16);
/* fp32_linear.c, int8_linear.c, w8a8_linear.c */
void rtpkv_fp32_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y);
void rtpkv_bf16w_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                        const float *bias, float *y);
void rtpkv_linear_many(int64_t count, const float *const *x, const int64_t *M, int64_t K,
                       const void *const *w, int64_t N, float *const *y, int bf16);
void rtpkv_int8_linear(const float *x, int64_t m, int64_t k, const int8_t *q, const float *s,
                       int64_t n, int64_t group, const float *bias, float *y, int64_t panel_rows);
void rtpkv_w8a8_linear(const float *x, int64_t m, int64_t k, const int8_t *qw, const float *sw,
                       int64_t n, const float *bias, float *y, int64_t many_rows_from);
void rtpkv_int8_linear_many(int64_t count, const float *const *x, const int64_t *m, int64_t k,
                            const int8_t *const *q, const float *const *s, int64_t n,
                            int64_t group, float *const *y, int64_t panel_rows);
void rtpkv_w8a8_linear_many(int64_t count, const float *const *x, const int64_t *m, int64_t k,
                            const int8_t *const *qw, const float *const *sw, int64_t n,
                            float *const *y, int64_t many_rows_from);

/* A linear layer as its kernel holds it (kernels/fused_decoder.py's _Linear), and the kernel of
 * each weight type (LINEAR_*: kernels/weight_types.py's kernel_kind): the one dispatch the
 * decoder (decoder.c) and a mixture's experts (moe_experts.c) share. */
typedef struct {
    const void *weight;            /* float32 or bf16 panels (fp32_linear), int8 blocks (int8_linear,
                                      w8a8_linear) */
    const float *scale;            /* int8 scales; NULL for float32 and bf16 */
    const float *bias;             /* NULL without */
} linear_layer;

enum { LINEAR_FP32, LINEAR_INT8, LINEAR_W8A8, LINEAR_BF16 };

/* y = x W^T + b for T rows of K inputs and N outputs, on the kernel of `kind`; `int8_group` is
 * LINEAR_INT8's group size, `panel_rows` the fewest rows the int8 kernels' prefill tiles take. */
static inline void rtpkv_linear(int64_t kind, const linear_layer *l, const float *x, int64_t T,
                                int64_t K, int64_t N, float *y, int64_t int8_group,
                                int64_t panel_rows) {
    switch (kind) {
    case LINEAR_INT8:
        rtpkv_int8_linear(x, T, K, (const int8_t *)l->weight, l->scale, N, int8_group, l->bias, y,
                          panel_rows);
        break;
    case LINEAR_W8A8:
        rtpkv_w8a8_linear(x, T, K, (const int8_t *)l->weight, l->scale, N, l->bias, y,
                          panel_rows);
        break;
    case LINEAR_FP32:
        rtpkv_fp32_linear(x, T, K, (const float *)l->weight, N, l->bias, y);
        break;
    case LINEAR_BF16:
        rtpkv_bf16w_linear(x, T, K, (const uint16_t *)l->weight, N, l->bias, y);
        break;
    default:
        abort();   /* the Python side sets one of LINEAR_* */
    }
}

/* A mixture-of-experts layer as moe_experts.c runs it (kernels/moe_experts.py), fixed at load;
 * the fused decoder (decoder.c) calls it for its sparse layers. */
typedef struct {
    linear_layer gate_up, down;
} expert_layer;

typedef struct {
    int64_t num_experts, top_k, hidden, inter;
    int64_t linear_kind;           /* LINEAR_*: the kernel of every expert's linear layers */
    int64_t int8_group;            /* LINEAR_INT8's group size */
    int64_t panel_rows;            /* the fewest rows the int8 kernels' prefill tiles take */
    const expert_layer *experts;   /* (num_experts,) */
    const float *router;           /* hidden -> num_experts, float32 panels (fp32_linear.c) */
    int64_t normalize;             /* renormalise the chosen experts' weights to sum to 1 */
    int64_t shared_inter;          /* the shared expert's intermediate size; 0: none */
    expert_layer shared;
    linear_layer shared_gate;      /* hidden -> 1; weight NULL: the shared expert ungated
                                      (Granite's) */
    const float *router_bias;      /* num_experts, padded to whole panels (gpt-oss's); NULL */
    int64_t softmax_after_top_k;   /* the weights a softmax over the top_k logits (gpt-oss,
                                      Granite), not the top_k of a softmax over all */
    int64_t activation;            /* MOE_SILU or MOE_CLAMPED_SWIGLU (gpt-oss's, with its
                                      alpha and limit) */
    float alpha, limit;
} moe_layer;

enum { MOE_SILU, MOE_CLAMPED_SWIGLU };

/* moe_experts.c: out (T, hidden) = the layer's MLP output of x (T, hidden). */
void rtpkv_moe_forward(const moe_layer *m, const float *x, int64_t T, float *out);

#endif
