// A row of x quantized to int8 per group of the weights, AVX-512: in one plane, or two (the
// rounding of x and of what that left, near f32; lowbit_multiply.hpp's quantize).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "lowbit_layout.hpp"

namespace vinoserve {
namespace {

// One group of 16 or 32 values: scale amax / 127, values rounded to nearest (even), as the plugin
// and llama.cpp's q8 do; `rest`, if given, gets what the rounding left (v - d * q).
void quantize_group(const float* v, size_t group, int8_t* q, float& d, int32_t& s, float* rest) {
    __m512 amax = _mm512_setzero_ps();
    for (size_t i = 0; i < group; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
    d = _mm512_reduce_max_ps(amax) / 127.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (size_t i = 0; i < group; i += 16) {
        const __m512 x16 = _mm512_loadu_ps(v + i);
        const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(x16, inv));
        sum = _mm512_add_epi32(sum, n);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(n));
        if (rest) _mm512_storeu_ps(rest + i, _mm512_fnmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(n), x16));
    }
    s = _mm512_reduce_add_epi32(sum);
}

// What the first plane's rounding left (|rest| <= d1 / 2), rounded at the scale d1 / FINE,
// within +-127 (only an exact tie reaches 128; -128 would wrap in the AVX2 path's sign trick);
// returns the integers' sum.
int32_t quantize_rest(const float* rest, size_t group, float d1, int8_t* q) {
    const __m512 inv = _mm512_set1_ps(d1 > 0.f ? FINE / d1 : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (size_t i = 0; i < group; i += 16) {
        const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(rest + i), inv));
        const __m128i n8 = _mm512_cvtsepi32_epi8(_mm512_max_epi32(n, _mm512_set1_epi32(-127)));
        sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(n8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), n8);
    }
    return _mm512_reduce_add_epi32(sum);
}

// The group's inputs summed as they are (16 lanes from zero, then reduced).
inline float group_sum(const float* v, size_t group) {
    __m512 total = _mm512_setzero_ps();
    for (size_t i = 0; i < group; i += 16) total = _mm512_add_ps(total, _mm512_loadu_ps(v + i));
    return _mm512_reduce_add_ps(total);
}

}  // namespace
}  // namespace vinoserve
