/* Vector maths shared by the C kernels (AVX2 + FMA, 8 float lanes). */
#ifndef RTPKV_VEC_MATH_H
#define RTPKV_VEC_MATH_H

#include <immintrin.h>
#include <stdint.h>

/* 8 bfloat16 values widened to float32 (exact: the bits shifted into the high half). */
static inline __m256 load_bf16x8(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* exp(c) for c already clamped to [-87, 88] (Cephes polynomial, ~1 ulp). Every FMA is written
 * out, so the bits do not depend on the compiler's contraction choices. */
static inline __m256 exp_clamped(__m256 c) {
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(c, _mm256_set1_ps(1.44269504088896341f),
                                                     _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), c));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* cap * tanh(x / cap) (Gemma 2's soft-capping of attention scores and logits), tanh(y) as
 * sign(y) (1 - e) / (1 + e) with e = exp(-2|y|), which keeps its precision at both ends. */
static inline __m256 softcap8(__m256 x, __m256 cap) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 y = _mm256_div_ps(x, cap);
    const __m256 e = exp_clamped(_mm256_max_ps(
        _mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, y)), _mm256_set1_ps(-87.0f)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign, y)), cap);
}

/* Stores the 8 lanes of `acc` as outputs n0 .. n0 + 7 of a row y of n, plus the bias where
 * there is one; lanes past n are zero-padded channels and are dropped. */
static inline void store_lanes(float *y, int64_t n, int64_t n0, __m256 acc, const float *bias) {
    if (n0 >= n) return;
    const int64_t valid = n - n0 < 8 ? n - n0 : 8;
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int64_t i = 0; i < valid; i++) y[n0 + i] = bias ? out[i] + bias[n0 + i] : out[i];
}

#endif
