// x quantized to int8 per group of the weights for vinoserve::LowBitMatMul (lowbit_kernels.hpp
// multiplies it): in one plane, or two (the rounding of x and of what that left, near f32).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

namespace vinoserve {
namespace {

// From this many rows of x, tiles run in pairs sharing each broadcast of x (Zen 5, [8,960 x
// 1,536] Q4_0 at 256 rows: 0.9x the time; 16 rows 0.85x), and rows are quantized in parallel.
constexpr size_t PAIR_ROWS = 8;

// x quantized per group: int8 values, a scale and the integer sum per group. In two planes a
// group is d1 q1 + d1 / 256 q2: one integer 256 q1 + q2 at scale d1 / 256, so `d` and `s` are per
// row of x and group in either case (s: of that integer).
struct Activations {
    // not std::vector, whose zeroing would be a serial pass over a prompt's int8s
    std::unique_ptr<int8_t[]> q;  // per row of x, `planes` rows: its int8s, then those of what they left
    std::unique_ptr<float[]> d;
    std::unique_ptr<int32_t[]> s;
    std::unique_ptr<float[]> sum;  // per row of x, the group's inputs summed as they are
};

constexpr int FINE = 256;  // the second plane's scale: the first's / FINE (a shift by 8 in the sums)

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

// What the first plane's rounding left (|rest| <= d1 / 2), rounded at the scale d1 / FINE
// (saturating: only an exact tie reaches 128); returns the integers' sum.
int32_t quantize_rest(const float* rest, size_t group, float d1, int8_t* q) {
    const __m512 inv = _mm512_set1_ps(d1 > 0.f ? FINE / d1 : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (size_t i = 0; i < group; i += 16) {
        const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(rest + i), inv));
        const __m128i n8 = _mm512_cvtsepi32_epi8(n);
        sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(n8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), n8);
    }
    return _mm512_reduce_add_epi32(sum);
}

// One row's k values at x, as row r of `a`.
void quantize_row(const float* x, size_t r, size_t k, size_t group, int planes, Activations& a) {
    const size_t groups = k / group;
    float rest[32];
    for (size_t g = 0; g < groups; g++) {
        const float* v = x + g * group;
        const size_t at = r * groups + g;
        __m512 total = _mm512_setzero_ps();
        for (size_t i = 0; i < group; i += 16) total = _mm512_add_ps(total, _mm512_loadu_ps(v + i));
        a.sum[at] = _mm512_reduce_add_ps(total);
        int8_t* q = a.q.get() + r * planes * k + g * group;
        quantize_group(v, group, q, a.d[at], a.s[at], planes == 2 ? rest : nullptr);
        if (planes == 2) {
            a.s[at] = FINE * a.s[at] + quantize_rest(rest, group, a.d[at], q + k);
            a.d[at] /= FINE;
        }
    }
}

// Each row of x as `planes` int8 rows per group: the first its values', a second (planes 2) what
// the first's rounding left, at a scale 256 times finer (x = d1 q1 + d1 / 256 q2 to ~2^-16 of the
// group's largest value: closer to f32 than bf16's 2^-9, for twice the dot products). Buffers of
// its own per call (a few KiB a decode step): a thread waiting in parallel_for may run another
// node's call, so a thread's buffer could be rewritten under its readers. `pick`: which row of x
// each of the `rows` is (nullptr: the first `rows`).
Activations quantize(const float* x, size_t rows, size_t k, size_t group, int planes, const size_t* pick = nullptr) {
    const size_t groups = k / group;
    Activations a{std::unique_ptr<int8_t[]>(new int8_t[rows * planes * k]),
                  std::unique_ptr<float[]>(new float[rows * groups]),
                  std::unique_ptr<int32_t[]>(new int32_t[rows * groups]),
                  std::unique_ptr<float[]>(new float[rows * groups])};
    if (rows < PAIR_ROWS) {
        for (size_t r = 0; r < rows; r++) quantize_row(x + (pick ? pick[r] : r) * k, r, k, group, planes, a);
        return a;
    }
    tbb::parallel_for(tbb::blocked_range<size_t>(0, rows), [&](const tbb::blocked_range<size_t>& range) {
        for (size_t r = range.begin(); r != range.end(); r++) quantize_row(x + (pick ? pick[r] : r) * k, r, k, group, planes, a);
    }, tbb::static_partitioner());
    return a;
}

}  // namespace
}  // namespace vinoserve
