// A row of x quantized to int8 per group of the weights, AVX2: the AVX-512 path's steps
// (lowbit_activations_avx512.hpp) in registers of 8 floats, its sums added in the same order, so
// both paths give the same integers, scales and sums bit for bit.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "lowbit_layout.hpp"

namespace vinoserve {
namespace {

// _mm512_reduce_add_ps of the 16 floats [lo, hi], in its order: halves, quarters, then pairs.
inline float reduce_add(__m256 lo, __m256 hi) {
    const __m256 eighths = _mm256_add_ps(hi, lo);
    const __m128 fours = _mm_add_ps(_mm256_extractf128_ps(eighths, 1), _mm256_castps256_ps128(eighths));
    const __m128 twos = _mm_add_ps(fours, _mm_shuffle_ps(fours, fours, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(twos) + _mm_cvtss_f32(_mm_shuffle_ps(twos, twos, _MM_SHUFFLE(1, 1, 1, 1)));
}

inline int32_t reduce_add(__m256i v) {
    const __m128i fours = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    const __m128i twos = _mm_add_epi32(fours, _mm_shuffle_epi32(fours, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(twos, _mm_shuffle_epi32(twos, _MM_SHUFFLE(1, 1, 1, 1))));
}

// 8 int32s within +-127 (the AVX-512 path's quantize_rest) as int8s at q; returns them clamped.
inline __m256i store_int8(__m256i n, int8_t* q) {
    n = _mm256_max_epi32(_mm256_min_epi32(n, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n, n), _mm256_setzero_si256());
    const int32_t lo = _mm_cvtsi128_si32(_mm256_castsi256_si128(bytes)), hi = _mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1));
    std::memcpy(q, &lo, 4);
    std::memcpy(q + 4, &hi, 4);
    return n;
}

// One group of 16 or 32 values: scale amax / 127, values rounded to nearest (even); `rest`, if
// given, gets what the rounding left (v - d * q).
void quantize_group(const float* v, size_t group, int8_t* q, float& d, int32_t& s, float* rest) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (size_t i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    d = _mm_cvtss_f32(_mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 1, 1, 1)))) / 127.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (size_t i = 0; i < group; i += 8) {
        const __m256 x8 = _mm256_loadu_ps(v + i);
        const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(x8, inv));
        sum = _mm256_add_epi32(sum, n);
        store_int8(n, q + i);
        if (rest) _mm256_storeu_ps(rest + i, _mm256_fnmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(n), x8));
    }
    s = reduce_add(sum);
}

// What the first plane's rounding left, rounded at the scale d1 / FINE, within +-127; returns
// the integers' sum.
int32_t quantize_rest(const float* rest, size_t group, float d1, int8_t* q) {
    const __m256 inv = _mm256_set1_ps(d1 > 0.f ? FINE / d1 : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (size_t i = 0; i < group; i += 8)
        sum = _mm256_add_epi32(sum, store_int8(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(rest + i), inv)), q + i));
    return reduce_add(sum);
}

// The group's inputs summed as the AVX-512 path sums them: 16 lanes from zero, then reduced.
inline float group_sum(const float* v, size_t group) {
    __m256 lo = _mm256_add_ps(_mm256_setzero_ps(), _mm256_loadu_ps(v)), hi = _mm256_add_ps(_mm256_setzero_ps(), _mm256_loadu_ps(v + 8));
    for (size_t i = 16; i < group; i += 16) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(v + i));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(v + i + 8));
    }
    return reduce_add(lo, hi);
}

}  // namespace
}  // namespace vinoserve
