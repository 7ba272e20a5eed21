/* The elementwise steps of a decoder layer fused into one pass each over memory: RMSNorm (with
 * the residual add before it), SiLU(gate) * up, GELU(gate) * up, RoPE in place, and the int8
 * KV cache's quantized write. Rows are independent and each is computed the same way whatever
 * the number of rows, so these keep batch invariance. Values are float32 or bfloat16; bfloat16
 * results are rounded (to nearest even) where torch's ops round them, so the numbers follow the
 * torch reference of kernels/norm.py, rope.py, activation.py and kv_quant.py (RoPE and the
 * int8 write bit for bit, the others to float32 rounding).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#include "kernels.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the fused CPU ops need AVX2 and FMA"
#endif

typedef __m256 v8;

static inline v8 load8(const void *p, int64_t i, int bf16) {
    return bf16 ? load_bf16x8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* bfloat16 rounding to nearest even, kept in float32 lanes (the low 16 bits cleared). */
static inline v8 round_bf16(v8 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void store8(void *p, int64_t i, v8 x, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, x);
        return;
    }
    __m256i u = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(x)), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extractf128_si256(u, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
}

/* Rounds x as an op of the tensor's dtype would. */
static inline v8 as_dtype(v8 x, int bf16) { return bf16 ? round_bf16(x) : x; }

/* exp(x) on 8 lanes, saturating to 0 below -87 and to +inf above 88. */
static inline v8 exp8(v8 x) {
    const v8 low = _mm256_set1_ps(-87.0f), high = _mm256_set1_ps(88.0f);
    const v8 y = _mm256_andnot_ps(_mm256_cmp_ps(x, low, _CMP_LT_OQ),
                                  exp_clamped(_mm256_min_ps(_mm256_max_ps(x, low), high)));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, high, _CMP_GT_OQ));
}

#if defined(__AVX512F__)
/* exp8 on 16 lanes (RTPKV_ISA=avx512): the same operations on each lane, so the same bits. */
static inline __m512 exp16(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.0f), high = _mm512_set1_ps(88.0f);
    const __m512 y = _mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(x, low, _CMP_NLT_UQ),
        exp_clamped16(_mm512_min_ps(_mm512_max_ps(x, low), high)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, high, _CMP_GT_OQ), y,
                                _mm512_set1_ps(INFINITY));
}
#endif

/* One row of rtpkv_rms_norm: the `dim` values at offset o. */
static inline void norm_row(const void *x, void *residual, const void *weight, void *out,
                            int64_t o, int64_t dim, float eps, int bf16) {
    v8 sq = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += 8) {
        v8 h = load8(x, o + i, bf16);
        if (residual) {
            h = as_dtype(_mm256_add_ps(load8(residual, o + i, bf16), h), bf16);
            store8(residual, o + i, h, bf16);
        }
        sq = _mm256_fmadd_ps(h, h, sq);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(sq), _mm256_extractf128_ps(sq, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    const v8 inv = _mm256_set1_ps(1.0f / sqrtf(_mm_cvtss_f32(s) / (float)dim + eps));
    const void *src = residual ? residual : x;
    for (int64_t i = 0; i < dim; i += 8) {
        const v8 h = as_dtype(_mm256_mul_ps(load8(src, o + i, bf16), inv), bf16);
        store8(out, o + i, _mm256_mul_ps(load8(weight, i, bf16), h), bf16);
    }
}

/* out = weight * (h / sqrt(mean(h^2) + eps)) per row, where h = x, or h = residual + x written
 * back to residual when residual is not NULL. Rows of `dim` values; dim a multiple of 8. */
void rtpkv_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                    int64_t dim, float eps, int bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x, residual, weight, out, r * dim, dim, eps, bf16);
}

/* rtpkv_rms_norm in place, float32, over the first `heads` rows of `dim` values of each of T
 * rows `stride` floats apart: the q (or k) heads of the fused decoder's qkv rows (q/k norms),
 * each head computed as rtpkv_rms_norm computes a row, so as the per-layer path's norm of the
 * heads made contiguous. */
void rtpkv_head_norm(float *x, int64_t T, int64_t stride, int64_t heads, int64_t dim,
                     const float *weight, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < T * heads; w++) {
        float *row = x + (w / heads) * stride;
        norm_row(row, NULL, weight, row, (w % heads) * dim, dim, eps, 0);
    }
}

/* out[r] = silu(gate_up[r][:inter]) * gate_up[r][inter:], silu(g) = g / (1 + exp(-g)); float32
 * 16 lanes at a time where the build has AVX-512 (the same operations on each lane). */
void rtpkv_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
#if defined(__AVX512F__)
        if (!bf16) {
            const float *gu = (const float *)gate_up + r * 2 * inter;
            for (; i + 16 <= inter; i += 16) {
                const __m512 g = _mm512_loadu_ps(gu + i), u = _mm512_loadu_ps(gu + inter + i);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
                const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                _mm512_storeu_ps((float *)out + r * inter + i, _mm512_mul_ps(silu, u));
            }
        }
#endif
        for (; i < inter; i += 8) {
            const v8 g = load8(gate_up, r * 2 * inter + i, bf16);
            const v8 u = load8(gate_up, r * 2 * inter + inter + i, bf16);
            const v8 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const v8 silu = as_dtype(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), bf16);
            store8(out, r * inter + i, _mm256_mul_ps(silu, u), bf16);
        }
    }
}

/* gpt-oss's clamped SwiGLU: out[r] = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
 * g = min(gate, limit), sigmoid(x) = 1 / (1 + exp(-x)), gate = gate_up[r][:inter] and
 * up = gate_up[r][inter:]. */
void rtpkv_clamped_swiglu(const void *gate_up, void *out, int64_t rows, int64_t inter,
                          float alpha, float limit, int bf16) {
    const v8 a = _mm256_set1_ps(alpha), hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
    const v8 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < inter; i += 8) {
            const v8 g = _mm256_min_ps(load8(gate_up, r * 2 * inter + i, bf16), hi);
            const v8 u = _mm256_max_ps(_mm256_min_ps(load8(gate_up, r * 2 * inter + inter + i,
                                                           bf16), hi), lo);
            const v8 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(g, a)));
            const v8 glu = as_dtype(_mm256_div_ps(g, _mm256_add_ps(one, e)), bf16);
            store8(out, r * inter + i, _mm256_mul_ps(as_dtype(_mm256_add_ps(u, one), bf16), glu),
                   bf16);
        }
    }
}

/* out[r] = gelu(gate_up[r][:inter]) * gate_up[r][inter:] with GELU's tanh approximation
 * (transformers' gelu_pytorch_tanh): 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3),
 * computed as g / (1 + exp(-2y)), the same value without tanh's cancellation near -1. */
void rtpkv_gelu_tanh_and_mul(const void *gate_up, void *out, int64_t rows, int64_t inter,
                             int bf16) {
    const v8 one = _mm256_set1_ps(1.0f), cubic = _mm256_set1_ps(0.044715f);
    const v8 minus_two_c = _mm256_set1_ps(-2.0f * 0.7978845608028654f);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < inter; i += 8) {
            const v8 g = load8(gate_up, r * 2 * inter + i, bf16);
            const v8 u = load8(gate_up, r * 2 * inter + inter + i, bf16);
            const v8 inner = _mm256_fmadd_ps(_mm256_mul_ps(cubic, g), _mm256_mul_ps(g, g), g);
            const v8 e = exp8(_mm256_mul_ps(minus_two_c, inner));
            const v8 gelu = as_dtype(_mm256_div_ps(g, _mm256_add_ps(one, e)), bf16);
            store8(out, r * inter + i, _mm256_mul_ps(gelu, u), bf16);
        }
    }
}

/* x = cap * tanh(x / cap) in place over n float32 values (Gemma 2's final logit soft-cap): each
 * value computed alone (vec_math.h's softcap8), the last n % 8 through a padded vector. */
void rtpkv_softcap(float *x, int64_t n, float cap) {
    const v8 c = _mm256_set1_ps(cap);
    const int64_t whole = n - n % 8;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < whole; i += 8)
        _mm256_storeu_ps(x + i, softcap8(_mm256_loadu_ps(x + i), c));
    if (whole == n) return;
    float tail[8] = {0};
    memcpy(tail, x + whole, (size_t)(n - whole) * sizeof(float));
    _mm256_storeu_ps(tail, softcap8(_mm256_loadu_ps(tail), c));
    memcpy(x + whole, tail, (size_t)(n - whole) * sizeof(float));
}

/* Rotates heads [0, heads) of each token in place: x1 * cos - x2 * sin, x2 * cos + x1 * sin
 * for the halves x1, x2 of a head (Llama's rotate_half), cos/sin rows taken at the token's
 * position. x: token t, head h at x + t * row_stride + h * dim. dim a multiple of 16. */
static void rope_heads(void *x, int64_t tokens, int64_t heads, int64_t row_stride, int64_t dim,
                       const void *cos, const void *sin, const int64_t *positions, int bf16) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t c = positions[t] * dim;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t o = t * row_stride + h * dim;
            for (int64_t i = 0; i < half; i += 8) {
                const v8 x1 = load8(x, o + i, bf16), x2 = load8(x, o + half + i, bf16);
                const v8 c1 = load8(cos, c + i, bf16), c2 = load8(cos, c + half + i, bf16);
                const v8 s1 = load8(sin, c + i, bf16), s2 = load8(sin, c + half + i, bf16);
                const v8 a1 = as_dtype(_mm256_mul_ps(x1, c1), bf16);
                const v8 b1 = as_dtype(_mm256_mul_ps(x2, s1), bf16);
                const v8 a2 = as_dtype(_mm256_mul_ps(x2, c2), bf16);
                const v8 b2 = as_dtype(_mm256_mul_ps(x1, s2), bf16);
                store8(x, o + i, _mm256_sub_ps(a1, b1), bf16);
                store8(x, o + half + i, _mm256_add_ps(a2, b2), bf16);
            }
        }
    }
}

void rtpkv_rope(void *q, void *k, int64_t tokens, int64_t q_heads, int64_t k_heads,
                int64_t q_stride, int64_t k_stride, int64_t dim, const void *cos, const void *sin,
                const int64_t *positions, int bf16) {
    rope_heads(q, tokens, q_heads, q_stride, dim, cos, sin, positions, bf16);
    rope_heads(k, tokens, k_heads, k_stride, dim, cos, sin, positions, bf16);
}

/* The int8 KV cache's write (kernels/kv_quant.py): each new token's K and V rows of every head
 * quantized into their pool rows of D int8 values and a float32 scale, scale = max|x| / 127,
 * q = round-half-even(x / scale) clamped to [-127, 127] (zeros where scale is 0): the bits of
 * kv_quant.quantize_rows. k, v: token t, head h at t * stride + h * D; rows: (KVH, T) pool
 * rows. D a multiple of 8. */
static void quantize_row(const void *x, int64_t offset, int8_t *row, int64_t D, int bf16) {
    const v8 sign = _mm256_set1_ps(-0.0f);
    v8 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(x, offset + i, bf16)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float scale = _mm_cvtss_f32(m) / 127.0f;
    const v8 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t i = 0; i < D; i += 8) {
        int32_t q[8];
        if (scale > 0.0f) {
            const v8 y = _mm256_round_ps(_mm256_div_ps(load8(x, offset + i, bf16), vs),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_storeu_si256((__m256i *)q,
                                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, lo), hi)));
        } else {
            memset(q, 0, sizeof(q));
        }
        for (int j = 0; j < 8; j++) row[i + j] = (int8_t)q[j];
    }
    memcpy(row + D, &scale, sizeof(scale));
}

void rtpkv_write_kv_int8(const void *k, const void *v, int8_t *k_cache, int8_t *v_cache,
                         const int64_t *rows, int64_t T, int64_t KVH, int64_t D, int64_t k_stride,
                         int64_t v_stride, int bf16) {
    const int64_t width = D + (int64_t)sizeof(float);
#pragma omp parallel for schedule(static) if (T * KVH >= 64)
    for (int64_t w = 0; w < T * KVH; w++) {
        const int64_t t = w / KVH, h = w % KVH, row = rows[h * T + t];
        quantize_row(k, t * k_stride + h * D, k_cache + row * width, D, bf16);
        quantize_row(v, t * v_stride + h * D, v_cache + row * width, D, bf16);
    }
}

/* Each row's arg-max, as torch.argmax takes it: the first NaN if there is one, else the first
 * index of the largest value. The greedy sampler's pick, without a torch op. */
void rtpkv_argmax(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        int64_t best = 0;
        float top = row[0];
        for (int64_t i = 1; i < cols && top == top; i++) {
            if (row[i] != row[i]) {
                best = i;
                break;
            }
            if (row[i] > top) {
                top = row[i];
                best = i;
            }
        }
        out[r] = best;
    }
}
