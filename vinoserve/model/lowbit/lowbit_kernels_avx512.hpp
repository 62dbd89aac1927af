// The AVX-512 paths of vinoserve::LowBitMatMul's arithmetic (lowbit_layout.hpp says what it
// computes and the weights' layout): 16 weight rows a zmm register, one vpdpbusd a 64-byte chunk.
// Built without VNNI (Skylake-SP), the products are the AVX2 path's at 512 bits: vpmaddubsw
// into 16-bit pair sums kept through as many chunks as cannot overflow, then vpmaddwd by ones
// into 32 (widening every chunk made a prompt product 1.2x the AVX2 path's time); 8-bit weights
// multiply with their sign. The integer sums are the VNNI path's, so the outputs are too.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lowbit_activations_avx512.hpp"
#include "lowbit_layout.hpp"

namespace vinoserve {
namespace {

#if defined(__AVX512VNNI__)
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// The layouts a prompt's pair of tiles keeps unpacked (PairTiles): 5- and 6-bit weights, and
// without VNNI all (4-bit: [8,960 x 1,536] Q4_0 / Q4_K at 256 rows 0.91x the time, AVX-512 code on
// an AMX Xeon). With VNNI Zen 5's 4-bit products took 1.04-1.07x, so they unpack in the kernel
// (benchmarks/results/2026-12-04-unpacked-prompt-tiles.md).
template <int BITS>
constexpr bool UNPACKED = TOP_PLANES<BITS> || !VNNI;

// Sums a chunk at a time in 32 bits (VNNI, or 8-bit weights' signed products), else in 16 first.
template <int BITS>
constexpr bool WIDE = VNNI || BITS == 8;

// What the integer sums need to take the weights' bias off: -bias times x's integers' sum (8-bit
// weights without VNNI, multiplied with their sign as w = u - 128: 128 - bias).
inline int bias_factor(const Weights& w) { return w.bits == 8 && !VNNI ? 128 - w.bias : -w.bias; }

// One chunk's products of 16 rows' 4 weights u with x's 4 bytes (broadcast in xb): into the
// 32-bit sums s (WIDE), or the 16-bit pair sums p.
template <int BITS>
inline void dot(__m512i u, __m512i xb, __m512i& s, __m512i& p) {
    if constexpr (VNNI) {
        s = _mm512_dpbusd_epi32(s, u, xb);
    } else if constexpr (BITS == 8) {  // |w| times x with w's sign (|x| <= 127: no wrap)
        const __m512i signed_x = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(u), _mm512_setzero_si512(), xb);
        s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(u), signed_x), _mm512_set1_epi16(1)));
    } else {
        p = _mm512_add_epi16(p, _mm512_maddubs_epi16(u, xb));
        asm("" : "+v"(p));  // the sum kept in its register (as the AVX2 path's)
    }
}

// The 16-bit pair sums p into the 32-bit sums s, p cleared (without VNNI).
inline void widen(__m512i& s, __m512i& p) {
    s = _mm512_add_epi32(s, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
    p = _mm512_setzero_si512();
}

inline __m512 load_half(const void* p, size_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
}

inline __m512 load_floats(const void* p, bool f16, size_t i) {
    return f16 ? load_half(p, i) : _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

// 16 integers of 6 bits, row j's at bits 6j of 12 bytes, as int32s: each one's two bytes into a
// 16-bit lane (both halves of the register hold the 12 bytes), shifted down. The 12 bytes load
// as 8 and 4 (a masked load made a one-row Q4_K product 1.35x slower on Zen 5).
inline __m512i six_bits(const uint8_t* p) {
    int32_t last;
    std::memcpy(&last, p + 8, 4);
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), last, 2));
    const __m256i pairs = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 2, 3, 3, 4, 3, 4, 4, 5, 5, 6,
                                                                       6, 7, 6, 7, 7, 8, 8, 9, 9, 10, 9, 10, 10, 11, 11, -1));
    const __m256i shift = _mm256_setr_epi16(0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2);
    return _mm512_cvtepu16_epi32(_mm256_and_si256(_mm256_srlv_epi16(pairs, shift), _mm256_set1_epi16(63)));
}

// Factored: the f16s of group g's block times g's integers (g counted over all tiles).
inline __m512 load_factored(const void* p, size_t g, const Weights& w) {
    const size_t block = size_t{1} << w.block_shift, ints = w.factor_bits == 6 ? 12 : 16;
    const uint8_t* at = static_cast<const uint8_t*>(p) + (g >> w.block_shift) * (32 + ints * block);
    const uint8_t* q = at + 32 + ints * (g & (block - 1));
    const __m512i q32 = w.factor_bits == 6 ? six_bits(q) : _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm512_mul_ps(load_half(at, 0), _mm512_cvtepi32_ps(q32));
}

// A tile's 16 scales and offsets of group g (groups: the row's).
inline void group_floats(const Weights& w, size_t t, size_t g, size_t groups, __m512& scale, __m512& offset) {
    const size_t at = t * groups + g;
    if (w.block_shift < 0) {
        scale = load_floats(w.scale, w.f16, at * 16);
        offset = w.offset ? load_floats(w.offset, w.f16, at * 16) : _mm512_setzero_ps();
        return;
    }
    scale = load_factored(w.scale, at, w);
    offset = w.offset ? _mm512_fmadd_ps(scale, _mm512_set1_ps(w.centre),
                                        load_factored(w.offset, at, w))
                      : _mm512_setzero_ps();
}

// Chunk c's top bits, moved to bits 4 (-5) of each byte, the rest zero.
template <int BITS>
inline __m512i top_bits(const uint8_t* planes, int c) {
    constexpr int PER = BITS == 6 ? 4 : 8;  // chunks a plane
    const __m512i p = _mm512_loadu_si512(planes + c / PER * 64);
    const int shift = 4 - (BITS - 4) * (c % PER);
    const __m512i moved = shift >= 0 ? _mm512_slli_epi16(p, shift) : _mm512_srli_epi16(p, -shift);
    return _mm512_and_si512(moved, _mm512_set1_epi8(BITS == 6 ? 0x30 : 0x10));
}

// Chunks c and c + Q / 2 of a tile's group at q (Q chunks; 4- to 6-bit: one load holds both),
// as unsigned bytes (8-bit weights without VNNI: signed, w = u - 128).
template <int BITS, int Q>
inline void unpack(const uint8_t* q, int c, __m512i& lo, __m512i& hi) {
    if constexpr (BITS == 8) {
        lo = _mm512_loadu_si512(q + c * 64);
        hi = _mm512_loadu_si512(q + (c + Q / 2) * 64);
        if constexpr (!VNNI) {  // w = u - 128, for dot's sign
            lo = _mm512_xor_si512(lo, _mm512_set1_epi8(-128));
            hi = _mm512_xor_si512(hi, _mm512_set1_epi8(-128));
        }
    } else {
        const __m512i low = _mm512_set1_epi8(0x0F), v = _mm512_loadu_si512(q + c * 64);
        if constexpr (TOP_PLANES<BITS>) {  // (v & low) | top in one op (0.96x a Q6_K prompt product's time)
            lo = _mm512_ternarylogic_epi32(v, top_bits<BITS>(q + Q * 32, c), low, 0xEC);
            hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), top_bits<BITS>(q + Q * 32, c + Q / 2), low, 0xEC);
        } else {
            lo = _mm512_and_si512(v, low);
            hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        if constexpr (BITS == E2M1) {
            const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(E2M1_TABLE)));
            lo = _mm512_shuffle_epi8(table, lo);
            hi = _mm512_shuffle_epi8(table, hi);
        }
    }
}

// The group's integer sums (256 s1 + s2 in two planes) into a row's accumulator.
inline __m512 accumulate(const Weights& w, const Activations& a, size_t ag, __m512i s, __m512 scale, __m512 offset, __m512 acc) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(a.d[ag])), acc);
    return w.offset ? _mm512_fmadd_ps(offset, _mm512_set1_ps(a.sum[ag]), acc) : acc;
}

inline void store(const Outputs& y, size_t t, size_t row, const __m512& acc) {
    const Column c = column(y, t, row);
    _mm512_mask_storeu_ps(c.at, static_cast<__mmask16>((1u << c.live) - 1), acc);
}

// Tile t against MB rows of x from row m0, groups outermost (a group's weights unpacked into
// registers once for the MB rows): fewer than PAIR_ROWS rows, decode steps. Q = weights a group
// / 4; P: planes a row of x was quantized to.
template <int MB, int BITS, int Q, int P>
void tile_kernel(const Weights& w, const Activations& a, size_t m0, size_t t, const Outputs& y) {
    const size_t groups = w.k / (4 * Q);
    const uint8_t* q = w.q + t * w.tile_bytes();
    __m512 acc[MB];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    for (size_t g = 0; g < groups; g++) {
        prefetch_ahead<BITS, Q>(w, q);
        __m512i u[Q];
        for (int c = 0; c < Q / 2; c++) unpack<BITS, Q>(q, c, u[c], u[c + Q / 2]);
        q += Q * STORED<BITS> * 8;
        __m512 scale, offset;
        group_floats(w, t, g, groups, scale, offset);
        for (int m = 0; m < MB; m++) {
            const size_t ag = (m0 + m) * groups + g;
            const int32_t* x4 = reinterpret_cast<const int32_t*>(a.q.get() + (m0 + m) * P * w.k + g * 4 * Q);
            // two chains of dot products: one is latency-bound at one row of x (a 1.5B step 0.92x
            // the time); with two planes, a chain each (the second's with the bias); without VNNI
            // a plane's 16-bit sums are the chain (vpaddw's latency is 1)
            __m512i s[2] = {_mm512_setzero_si512(), _mm512_set1_epi32(a.c[ag])}, p[2];
            for (int i = 0; i < 2; i++) p[i] = _mm512_setzero_si512();
            for (int pl = 0; pl < P; pl++)
                for (int c = 0; c < Q; c++) {
                    const int i = P == 2 ? pl : (WIDE<BITS> ? c % 2 : 0);
                    dot<BITS>(u[c], _mm512_set1_epi32(x4[pl * w.k / 4 + c]), s[i], p[i]);
                    if (!WIDE<BITS> && ((c + 1) % (2 * PAIRS16<BITS>) == 0 || c == Q - 1)) widen(s[i], p[i]);
                }
            if constexpr (P == 2) {
                s[0] = _mm512_add_epi32(_mm512_slli_epi32(s[0], 8), s[1]);
            } else {
                s[0] = _mm512_add_epi32(s[1], s[0]);
            }
            acc[m] = accumulate(w, a, ag, s[0], scale, offset, acc[m]);
        }
    }
    for (int m = 0; m < MB; m++) store(y, t, m0 + m, acc[m]);
}

// What pair_kernel reads of tiles t and t + 1 for all the rows of x, prepared once where it would
// be again every few rows: scales and offsets in f32, per tile and group 16 floats (K-quants'
// factors: a Q4_K prompt product 0.94x the time, Q6_K's 0.84x; Zen 5; the same floats, so the same
// sums); weights unpacked (UNPACKED), per tile, group and chunk 64 bytes (their shifts and masks
// crowded the dot products: a Q6_K product 0.88x the time). In the thread's buffers, kept between
// calls (allocated a pair, a Q4_0 product of 9 rows took 1.09x the time): nothing in run_tile
// waits on other tasks, so no other call takes the thread while they are used.
template <int BITS, int Q>
struct PairTiles {
    const size_t groups;
    float *scale, *offset;
    __m512i* bytes;  // UNPACKED layouts only

    PairTiles(const Weights& w, size_t t) : groups(w.k / w.group) {
        static thread_local std::vector<__m512> floats;
        static thread_local std::vector<__m512i> unpacked;
        floats.resize(std::max(floats.size(), 4 * groups));
        scale = reinterpret_cast<float*>(floats.data());
        offset = w.offset ? scale + 2 * groups * 16 : nullptr;
        if constexpr (UNPACKED<BITS>) unpacked.resize(std::max(unpacked.size(), 2 * groups * Q));
        bytes = UNPACKED<BITS> ? unpacked.data() : nullptr;
        for (size_t j = 0; j < 2; j++) {
            const uint8_t* q = w.q + (t + j) * w.tile_bytes();
            for (size_t g = 0; g < groups; g++, q += Q * STORED<BITS> * 8) {
                __m512 s, o;
                group_floats(w, t + j, g, groups, s, o);
                _mm512_storeu_ps(&scale[(j * groups + g) * 16], s);
                if (w.offset) _mm512_storeu_ps(&offset[(j * groups + g) * 16], o);
                if constexpr (UNPACKED<BITS>)
                    for (int c = 0; c < Q / 2; c++) unpack<BITS, Q>(q, c, bytes[at(j, g, c)], bytes[at(j, g, c + Q / 2)]);
            }
        }
    }

    size_t at(size_t j, size_t g, int c) const { return (j * groups + g) * Q + c; }  // a chunk's 64 bytes in `bytes`
};

// Tiles t and t + 1 against MB rows of x, chunks outermost: each unpacked chunk meets every row's
// planes while it is in a register, and the rows' int32 sums stay in registers through the group,
// so no register holds a whole group's weights. Three rows of two planes, four of one, fit the 32
// registers ([8,960 x 1,536] Q4_0 at 256 rows: 0.92x and 0.82x the time of groups outermost, whose
// rows spilled; Zen 5; four rows of two planes 1.02-1.06x). A group's chunks unrolled: GCC otherwise
// moves a third of the sums between registers on each chunk's back edge (0.87-0.96x the time).
template <int MB, int BITS, int Q, int P>
void pair_kernel(const Weights& w, const Activations& a, const PairTiles<BITS, Q>& f, size_t m0, size_t t, const Outputs& y) {
    const size_t groups = f.groups;
    const uint8_t* q[2] = {w.q + t * w.tile_bytes(), w.q + (t + 1) * w.tile_bytes()};
    __m512 acc[2][MB];
    for (int j = 0; j < 2; j++)
        for (int m = 0; m < MB; m++) acc[j][m] = _mm512_setzero_ps();
    for (size_t g = 0; g < groups; g++) {
        __m512i s[P][2][MB], p16[P][2][MB];  // per plane, tile and row; the last plane's starts at the bias
        for (int m = 0; m < MB; m++) {
            const __m512i bias = _mm512_set1_epi32(a.c[(m0 + m) * groups + g]);
            for (int j = 0; j < 2; j++) {
                s[P - 1][j][m] = bias;
                if constexpr (P == 2) s[0][j][m] = _mm512_setzero_si512();
                for (int pl = 0; pl < P; pl++) p16[pl][j][m] = _mm512_setzero_si512();
            }
        }
        // later rows find the pair's weights in cache (0.95x a Q4_0 / Q4_K prompt product's time)
        if (!UNPACKED<BITS> && m0 == 0)
            for (int j = 0; j < 2; j++) prefetch_ahead<BITS, Q>(w, q[j]);
#pragma GCC unroll 8
        for (int c = 0; c < Q / 2; c++) {
            __m512i u[2][2];
            for (int j = 0; j < 2; j++) {
                if constexpr (UNPACKED<BITS>) {
                    u[j][0] = f.bytes[f.at(j, g, c)];
                    u[j][1] = f.bytes[f.at(j, g, c + Q / 2)];
                } else {
                    unpack<BITS, Q>(q[j], c, u[j][0], u[j][1]);
                }
            }
            for (int h = 0; h < 2; h++)
                for (int m = 0; m < MB; m++) {
                    const int32_t* x4 = reinterpret_cast<const int32_t*>(a.q.get() + (m0 + m) * P * w.k + g * 4 * Q) + c + h * Q / 2;
                    for (int p = 0; p < P; p++) {
                        const __m512i xb = _mm512_set1_epi32(x4[p * w.k / 4]);
                        for (int j = 0; j < 2; j++) dot<BITS>(u[j][h], xb, s[p][j][m], p16[p][j][m]);
                    }
                }
            if constexpr (!WIDE<BITS>) {
                if ((c + 1) % PAIRS16<BITS> == 0 || c == Q / 2 - 1)  // before 16 bits overflow
                    for (int p = 0; p < P; p++)
                        for (int j = 0; j < 2; j++)
                            for (int m = 0; m < MB; m++) widen(s[p][j][m], p16[p][j][m]);
            }
        }
        for (int j = 0; j < 2; j++) {
            q[j] += Q * STORED<BITS> * 8;
            const __m512 scale = _mm512_loadu_ps(f.scale + (j * groups + g) * 16);
            const __m512 offset = w.offset ? _mm512_loadu_ps(f.offset + (j * groups + g) * 16) : _mm512_setzero_ps();
            for (int m = 0; m < MB; m++) {
                const __m512i sum = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(s[0][j][m], 8), s[P - 1][j][m]) : s[0][j][m];
                acc[j][m] = accumulate(w, a, (m0 + m) * groups + g, sum, scale, offset, acc[j][m]);
            }
        }
    }
    for (int j = 0; j < 2; j++)
        for (int m = 0; m < MB; m++) store(y, t + j, m0 + m, acc[j][m]);
}

// Tiles t, t + 1 (pair) or t alone against every row of x.
template <int BITS, int Q, int P>
void run_tile(const Weights& w, const Activations& a, size_t rows, size_t t, bool pair, const Outputs& y) {
    size_t m = 0;
    if (pair) {
        constexpr int MB = P == 2 ? 3 : 4;
        const PairTiles<BITS, Q> f(w, t);
        for (; m + MB <= rows; m += MB) pair_kernel<MB, BITS, Q, P>(w, a, f, m, t, y);
        if (m + 2 <= rows) { pair_kernel<2, BITS, Q, P>(w, a, f, m, t, y); m += 2; }
        if (m < rows) pair_kernel<1, BITS, Q, P>(w, a, f, m, t, y);
        return;
    }
    for (; m + 8 <= rows; m += 8) tile_kernel<8, BITS, Q, P>(w, a, m, t, y);
    if (m + 4 <= rows) { tile_kernel<4, BITS, Q, P>(w, a, m, t, y); m += 4; }
    if (m + 2 <= rows) { tile_kernel<2, BITS, Q, P>(w, a, m, t, y); m += 2; }
    if (m < rows) tile_kernel<1, BITS, Q, P>(w, a, m, t, y);
}

}  // namespace
}  // namespace vinoserve
