/* The C kernels that csrc/decoder.c and csrc/moe_experts.c call, declared once: each kernel's source includes this
 * header too, so the compiler checks its definition against what the decoder calls (the Python
 * bindings in kernels/ declare their own ctypes signatures). */
#ifndef RTPKV_KERNELS_H
#define RTPKV_KERNELS_H

#include <stdint.h>

/* fused_ops.c */
void rtpkv_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                    int64_t dim, float eps, int bf16);
void rtpkv_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int bf16);
void rtpkv_rope(void *q, void *k, int64_t tokens, int64_t q_heads, int64_t k_heads,
                int64_t q_stride, int64_t k_stride, int64_t dim, const void *cos, const void *sin,
                const int64_t *positions, int bf16);
void rtpkv_argmax(const float *x, int64_t rows, int64_t cols, int64_t *out);
void rtpkv_write_kv_int8(const void *k, const void *v, int8_t *k_cache, int8_t *v_cache,
                         const int64_t *rows, int64_t T, int64_t KVH, int64_t D, int64_t k_stride,
                         int64_t v_stride, int bf16);
/* fp32_linear.c, int8_linear.c, w8a8_linear.c */
void rtpkv_fp32_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y);
void rtpkv_bf16w_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                        const float *bias, float *y);
void rtpkv_int8_linear(const float *x, int64_t m, int64_t k, const int8_t *q, const float *s,
                       int64_t n, int64_t group, const float *bias, float *y, int64_t panel_rows);
void rtpkv_w8a8_linear(const float *x, int64_t m, int64_t k, const int8_t *qw, const float *sw,
                       int64_t n, const float *bias, float *y, int64_t many_rows_from);

#endif
