// What every instruction set's path of vinoserve::LowBitMatMul (lowbit_matmul.cpp) shares: the
// arithmetic, the weights' layout, the activations' int8 form and where outputs go. Each path
// (lowbit_kernels_avx512.hpp, lowbit_kernels_avx2.hpp) computes the same float steps per row, so
// the paths agree bit for bit: x quantized to int8, then tiles of 16 weight rows against rows of x.
//
// As llama.cpp's q8 dot products: each row of x is quantized to int8 per group of the weights
// (scale amax / 127), the integer dot products are exact in int32 (VNNI), and per group
//     y += (sum_i u_i * xq_i - bias * sum_i xq_i) * scale * xd (+ offset * sum_i x_i)
// where u = q + bias is the weight made unsigned (bias 8 for i4, 128 for i8, 0 for unsigned types).
// In two planes each row of x is two int8 rows: its rounding and the rounding of what that left,
// summed as two rows' products (lowbit_multiply.hpp's quantize). The offset (a block's minimum, Q4_1 / Q4_K)
// multiplies the exact sum of the group's inputs, not of their int8 roundings (llama.cpp's q8_1
// sum): with the rounded sums the built-in Q4_1 model's long-context perplexity was 1.015x f32's,
// with exact ones 0.992x (the plugin's correction product, which this replaces, reads exact sums).
//
// Weight layout (written by pack.py): rows in tiles of 16, per tile and group the bytes one
// vpdpbusd reads: chunk c holds, for each of the 16 rows, 4 consecutive weights (64 bytes).
// 8-bit: chunk c = weights 4c..4c+3 of the group. 4-bit: the low nibbles of chunk c are weights
// 4c..4c+3 and the high nibbles weights 4(c + H)..4(c + H)+3, H = group / 8. 6-bit (Q6_K's
// values, 0.75 bytes a weight where 8 bits took 1) and 5-bit (Q5_K's, 0.625): their low four bits
// as the 4-bit layout, then the rest in 64-byte planes (top_bits).
// Scales (and offsets) per tile and group: 16 floats, one per row: f32, or f16 given as bytes (the
// plugin widens an f16 constant to f32: Q4_0 read 5 bits a weight, not the file's 4.5); or, for
// K-quants (block_shift >= 0), factored as the file stores them, in bytes: per tile and block of
// 2^block_shift groups 16 f16s, then per group 16 int8s, or (factor_bits 6: Q4_K's, Q5_K's) 16
// 6-bit integers in 12 bytes; scale = f16 * integer, exact in f32. An offset's factors are the
// block minimum's, o; the kernel adds back centre * scale, the centring weights.py applied (8 for
// Q4_K, 16 for Q5_K), rounded once as numpy's f32 sum was: offset = fma(scale, centre, o). 0.5625
// bytes a Q4_K weight (the file's) instead of 0.75, 0.82 a Q6_K one instead of 1.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace vinoserve {
namespace {

// From this many rows of x, tiles run in pairs sharing each broadcast of x (Zen 5, [8,960 x
// 1,536] Q4_0 at 256 rows: 0.9x the time; 16 rows 0.85x), and rows are quantized in parallel.
constexpr size_t PAIR_ROWS = 8;

// x quantized per group: int8 values, a scale, and the integers' sum times what the path's
// products need to take the weights' bias off (bias_factor: -bias, as an exact int32). In two planes
// a group is d1 q1 + d1 / 256 q2: one integer 256 q1 + q2 at scale d1 / 256, so `d` and `c` are per
// row of x and group in either case (c: of that integer).
struct Activations {
    // not std::vector, whose zeroing would be a serial pass over a prompt's int8s
    std::unique_ptr<int8_t[]> q;  // per row of x, `planes` rows: its int8s, then those of what they left
    std::unique_ptr<float[]> d;
    std::unique_ptr<int32_t[]> c;
    std::unique_ptr<float[]> sum;  // per row of x, the group's inputs summed as they are
};

constexpr int FINE = 256;  // the second plane's scale: the first's / FINE (a shift by 8 in the sums)

struct Weights {
    const uint8_t* q;
    const void* scale;   // plain: f16 (as bytes) or f32 per group; factored: bytes as above
    const void* offset;  // nullptr: none
    bool f16;
    int bits, group, bias;
    float centre;  // a float once, not converted again every group
    int block_shift, factor_bits;  // block_shift < 0: plain floats
    size_t n, k, prefetch;
    bool e2m1 = false;  // 4-bit codes read through E2M1_TABLE (MXFP4's), not 4-bit integers
    size_t tile_bytes() const { return 16 * k * bits / 8; }
};

// MXFP4's values (gpt-oss' experts: E2M1 codes, sign, two exponent bits and one mantissa bit) are
// no 4-bit integers, but doubled they are integers in [-12, 12]: a kernel path of its own (BITS
// E2M1) keeps the codes in the 4-bit layout, 4 bits a weight where the integers took 5, and reads
// each through a table as its doubled value plus 12 (unsigned, bias 12; pack.py writes the codes).
constexpr int E2M1 = 3;
constexpr int8_t E2M1_TABLE[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The bits a path's weight takes in memory, and its unsigned integers' largest value.
template <int BITS>
constexpr int STORED = BITS == E2M1 ? 4 : BITS;
template <int BITS>
constexpr int MAX_U = BITS == E2M1 ? 24 : (1 << BITS) - 1;

// Without VNNI, vpmaddubsw's pair sums (|x| <= 128, u <= MAX_U) add up in 16 bits for this many
// pairs of chunks (a path unpacks chunks c and c + Q / 2 together) before they must widen to 32.
template <int BITS>
constexpr int PAIRS16 = 32767 / (2 * 128 * MAX_U<BITS>) / 2;

// 5- and 6-bit weights keep their bits above the low four in 64-byte planes after those: per
// chunk one bit (5: bit c % 8 of plane c / 8) or two (6: bits 2(c % 4) of plane c / 4).
template <int BITS>
constexpr bool TOP_PLANES = BITS == 5 || BITS == 6;

// A group's weights w.prefetch bytes ahead, for every path (the tiles a thread runs lie end to
// end; the distance is the CPU class's, cpu_defaults.py): a 1.5B step 0.8-0.95x the time with the
// hardware's prefetching alone (Emerald Rapids). The count reads twice the group's lines (512
// bytes for a 256-byte Q4 group) and is load-bearing: halved, one-row products ran 1.02-1.07x
// slower on the AVX2 path (benchmarks/results/2026-12-04-six-bit-factors.md).
template <int BITS, int Q>
inline void prefetch_ahead(const Weights& w, const uint8_t* q) {
    for (int l = 0; l < Q * STORED<BITS> / 4; l++) _mm_prefetch(reinterpret_cast<const char*>(q) + w.prefetch + 64 * l, _MM_HINT_T0);
}

// Where the outputs go: y's columns in one part, or in up to 4 of whole tiles, each its own tensor
// (a fused q/k/v or gate/up product, split as it is stored rather than copied by a node after it).
struct Outputs {
    static constexpr int MAX = 4;
    float* data[MAX];
    size_t n[MAX], first_tile[MAX];
    int parts;
    const size_t* rows = nullptr;  // y's row for each row of the activations (nullptr: the same)
};

// Tile t's 16 columns of row `row` of y: where they start, and how many of them y has (the last
// tile's may be fewer).
struct Column {
    float* at;
    size_t live;
};

inline Column column(const Outputs& y, size_t t, size_t row) {
    int p = 0;
    while (p + 1 < y.parts && t >= y.first_tile[p + 1]) p++;
    const size_t col = (t - y.first_tile[p]) * 16;
    return {y.data[p] + (y.rows ? y.rows[row] : row) * y.n[p] + col, std::min<size_t>(16, y.n[p] - col)};
}

// A path's products of tile t (t and t + 1 with `pair`) against `rows` rows of x.
using TileFn = void (*)(const Weights&, const Activations&, size_t rows, size_t t, bool pair, const Outputs&);

}  // namespace
}  // namespace vinoserve
