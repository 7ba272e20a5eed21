/* Vector maths shared by the C kernels (AVX2 + FMA, 8 float lanes; where the build has AVX-512,
 * 16-lane forms doing the same arithmetic on each lane). */
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

#if defined(__AVX512F__)
/* exp_clamped on 16 lanes: the same operations on each lane, so the same bits. */
static inline __m512 exp_clamped16(__m512 c) {
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(c, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* softcap8 on 16 lanes: the same operations on each lane, so the same bits. */
static inline __m512 softcap16(__m512 x, __m512 cap) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 y = _mm512_div_ps(x, cap);
    const __m512 abs_y = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(y)));
    const __m512 e = exp_clamped16(_mm512_max_ps(
        _mm512_mul_ps(_mm512_set1_ps(-2.0f), abs_y), _mm512_set1_ps(-87.0f)));
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512i y_sign = _mm512_and_si512(sign, _mm512_castps_si512(y));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), y_sign)),
                         cap);
}
#endif

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
