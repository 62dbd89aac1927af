// The AVX2 path of vinoserve::LowBitMatMul's arithmetic (lowbit_layout.hpp says what it computes
// and the weights' layout), for every x86-64 CPU with AVX2, FMA and F16C: a tile's 16 weight rows
// in two halves of 8, one ymm register each; the float steps per row are the AVX-512 path's, so
// both give the same outputs bit for bit.
//
// Without VNNI the integer products are llama.cpp's AVX2 ones: vpmaddubsw multiplies unsigned
// weights by signed x and adds pairs into 16 bits, vpmaddwd by ones widens to 32. 4-bit weights
// keep a whole group's pair sums in 16 bits (8 chunks of at most 2 * 15 * 128), 5-bit 4 chunks,
// 6-bit 2; 8-bit weights take their sign as llama.cpp's q8_0 does (|w| times x with w's sign),
// since 255 * 128 * 2 overflows 16 bits. Built with AVX-VNNI (Alder Lake and later, Zen 5),
// vpdpbusd on ymm does each chunk in one instruction into 32 bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "lowbit_activations_avx2.hpp"
#include "lowbit_layout.hpp"

namespace vinoserve {
namespace {

#if defined(__AVXVNNI__)
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// The layouts a prompt's tile keeps unpacked (TileFloats): all whose bytes take instructions to
// read, every one but 8-bit weights with VNNI ([8,960 x 1,536] Q4_0 / Q4_K at 256 rows 0.93x the
// time on the AVX2 and AVX-VNNI paths, an AMX Xeon; the kernel runs near its ports' bound, so only
// fewer uops gain: benchmarks/results/2026-12-04-unpacked-prompt-tiles.md).
template <int BITS>
constexpr bool UNPACKED = BITS != 8 || !VNNI;

// Sums a chunk at a time in 32 bits (VNNI, or 8-bit weights' signed products), else in 16 first.
template <int BITS>
constexpr bool WIDE = VNNI || BITS == 8;

// What the integer sums need to take the weights' bias off: -bias times x's integers' sum (8-bit
// weights without VNNI, multiplied with their sign as w = u - 128: 128 - bias).
inline int bias_factor(const Weights& w) { return w.bits == 8 && !VNNI ? 128 - w.bias : -w.bias; }

inline __m256 load_half(const void* p, size_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
}

inline __m256 load_floats(const void* p, bool f16, size_t i) {
    return f16 ? load_half(p, i) : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

// Rows 8h..8h+7 of 16 integers of 6 bits (row j's at bits 6j of 12 bytes), as int32s: 8 of the
// 12 bytes broadcast in one load (a 6-byte copy cost a store-forwarding stall: a one-row Q4_K
// product took 3.5x the AVX-512 path's time), each row's two bytes shuffled into its lane and
// shifted down: 3 vector uops where shifting 64-bit lanes twice took 8 (1.5B Q4_K_M decode steps
// 0.95x the time: benchmarks/results/2026-12-04-six-bit-factors.md).
inline __m256i six_bits(const uint8_t* p, int h) {
    const __m256i bytes = _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 4 * h)));
    // row i's bits start at bit 6i of half h's 6 bytes, bytes 2h on in the 8 loaded (Z: a zero
    // byte, its top bit still set with 2h added)
    constexpr char Z = -128;
    const __m256i pairs = _mm256_setr_epi8(0, 1, Z, Z, 0, 1, Z, Z, 1, 2, Z, Z, 2, 3, Z, Z,
                                           3, 4, Z, Z, 3, 4, Z, Z, 4, 5, Z, Z, 5, 6, Z, Z);
    const __m256i shuffled = _mm256_shuffle_epi8(bytes, _mm256_add_epi8(pairs, _mm256_set1_epi8(static_cast<char>(2 * h))));
    return _mm256_and_si256(_mm256_srlv_epi32(shuffled, _mm256_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2)), _mm256_set1_epi32(63));
}

// Factored: half h of the f16s of group g's block times g's integers (g counted over all tiles).
inline __m256 load_factored(const void* p, size_t g, const Weights& w, int h) {
    const size_t block = size_t{1} << w.block_shift, ints = w.factor_bits == 6 ? 12 : 16;
    const uint8_t* at = static_cast<const uint8_t*>(p) + (g >> w.block_shift) * (32 + ints * block);
    const uint8_t* q = at + 32 + ints * (g & (block - 1));
    const __m256i q32 = w.factor_bits == 6 ? six_bits(q, h)
                                           : _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
    return _mm256_mul_ps(load_half(at, 8 * h), _mm256_cvtepi32_ps(q32));
}

// Half h of a tile's 8 scales and offsets of group g (groups: the row's).
inline void group_floats(const Weights& w, size_t t, size_t g, size_t groups, int h, __m256& scale, __m256& offset) {
    const size_t at = t * groups + g;
    if (w.block_shift < 0) {
        scale = load_floats(w.scale, w.f16, at * 16 + 8 * h);
        offset = w.offset ? load_floats(w.offset, w.f16, at * 16 + 8 * h) : _mm256_setzero_ps();
        return;
    }
    scale = load_factored(w.scale, at, w, h);
    offset = w.offset ? _mm256_fmadd_ps(scale, _mm256_set1_ps(w.centre), load_factored(w.offset, at, w, h))
                      : _mm256_setzero_ps();
}

// Chunk c's top bits for half h, moved to bits 4 (-5) of each byte, the rest zero.
template <int BITS>
inline __m256i top_bits(const uint8_t* planes, int c, int h) {
    constexpr int PER = BITS == 6 ? 4 : 8;  // chunks a plane
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes + c / PER * 64 + 32 * h));
    const int shift = 4 - (BITS - 4) * (c % PER);
    const __m256i moved = shift >= 0 ? _mm256_slli_epi16(p, shift) : _mm256_srli_epi16(p, -shift);
    return _mm256_and_si256(moved, _mm256_set1_epi8(BITS == 6 ? 0x30 : 0x10));
}

// Half h of chunks c and c + Q / 2 of a tile's group at q, as unsigned bytes (8-bit weights
// without VNNI: signed, w = u - 128, for their sign).
template <int BITS, int Q>
inline void unpack(const uint8_t* q, int c, int h, __m256i& lo, __m256i& hi) {
    const auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
    if constexpr (BITS == 8) {
        lo = load(q + c * 64 + 32 * h);
        hi = load(q + (c + Q / 2) * 64 + 32 * h);
        if constexpr (!VNNI) {
            lo = _mm256_xor_si256(lo, _mm256_set1_epi8(-128));
            hi = _mm256_xor_si256(hi, _mm256_set1_epi8(-128));
        }
    } else {
        const __m256i low = _mm256_set1_epi8(0x0F), v = load(q + c * 64 + 32 * h);
        lo = _mm256_and_si256(v, low);
        hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (BITS == E2M1) {
            const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(E2M1_TABLE)));
            lo = _mm256_shuffle_epi8(table, lo);
            hi = _mm256_shuffle_epi8(table, hi);
        }
        if constexpr (TOP_PLANES<BITS>) {
            lo = _mm256_or_si256(lo, top_bits<BITS>(q + Q * 32, c, h));
            hi = _mm256_or_si256(hi, top_bits<BITS>(q + Q * 32, c + Q / 2, h));
        }
    }
}

// One chunk's products of 8 rows' 4 weights u with x's 4 bytes (broadcast in xb): into the 32-bit
// sums s (WIDE), or the 16-bit pair sums p.
template <int BITS>
inline void dot(__m256i u, __m256i xb, __m256i& s, __m256i& p) {
    if constexpr (VNNI) {
        s = _mm256_dpbusd_avx_epi32(s, u, xb);
    } else if constexpr (BITS == 8) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(xb, u));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    } else {
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u, xb));
        // the sum kept where it is: GCC otherwise reorders the adds into a tree of spills (a 256-row
        // Q4_0 product 1.5x the time)
        asm("" : "+x"(p));
    }
}

// What a tile's weights read as floats for all the rows of x, prepared once where rows come in
// blocks (a prompt): per group 16 scales and offsets; the weights unpacked (UNPACKED), per group,
// chunk and half 32 bytes. In the thread's buffers, kept between calls (as the AVX-512 path's).
template <int BITS, int Q>
struct TileFloats {
    const size_t groups;
    float *scale, *offset;
    __m256i* bytes;  // UNPACKED layouts only

    TileFloats(const Weights& w, size_t t) : groups(w.k / w.group) {
        static thread_local std::vector<__m256> floats;
        static thread_local std::vector<__m256i> unpacked;
        floats.resize(std::max(floats.size(), 4 * groups));
        scale = reinterpret_cast<float*>(floats.data());
        offset = w.offset ? scale + groups * 16 : nullptr;
        if constexpr (UNPACKED<BITS>) unpacked.resize(std::max(unpacked.size(), 2 * groups * Q));
        bytes = UNPACKED<BITS> ? unpacked.data() : nullptr;
        const uint8_t* q = w.q + t * w.tile_bytes();
        for (size_t g = 0; g < groups; g++, q += Q * STORED<BITS> * 8)
            for (int h = 0; h < 2; h++) {
                __m256 s, o;
                group_floats(w, t, g, groups, h, s, o);
                _mm256_storeu_ps(&scale[g * 16 + 8 * h], s);
                if (w.offset) _mm256_storeu_ps(&offset[g * 16 + 8 * h], o);
                if constexpr (UNPACKED<BITS>)
                    for (int c = 0; c < Q / 2; c++) unpack<BITS, Q>(q, c, h, bytes[at(g, c, h)], bytes[at(g, c + Q / 2, h)]);
            }
    }

    size_t at(size_t g, int c, int h) const { return (g * 2 + h) * Q + c; }  // a chunk's half in `bytes`
};

inline void store(const Outputs& y, size_t t, size_t row, int h, __m256 acc) {
    const Column c = column(y, t, row);
    const size_t first = 8 * h;
    if (c.live >= first + 8) {
        _mm256_storeu_ps(c.at + first, acc);
    } else if (c.live > first) {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskstore_ps(c.at + first, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(c.live - first)), lanes), acc);
    }
}

// H halves of tile t from half h0 against MB rows of x from m0, groups outermost, a group's chunks
// unrolled. P: planes a row of x was quantized to; their sums are chains of their own, and with
// one plane and VNNI a chunk's low and high halves are (vpdpbusd's latency). `f`: the tile's
// floats prepared (PREP), or read here (a decode step reads each once). OFF: the weights have offsets.
template <int MB, int H, int BITS, int Q, int P, bool OFF, bool PREP>
void half_kernel(const Weights& w, const Activations& a, const TileFloats<BITS, Q>* f, size_t m0, size_t t, int h0,
                 const Outputs& y) {
    constexpr int C = P == 2 || VNNI ? 2 : 1;  // chains of sums
    const size_t groups = w.k / (4 * Q), row = P * w.k / 4;  // row: a row of x's int32s (4 bytes each)
    const uint8_t* q = w.q + t * w.tile_bytes();
    // the rows' x, their scales, bias corrections and sums per group, moved on a group at a time
    const int32_t* x4 = reinterpret_cast<const int32_t*>(a.q.get()) + m0 * row;
    const float *d = a.d.get() + m0 * groups, *xsum = a.sum.get() + m0 * groups;
    const int32_t* xc = a.c.get() + m0 * groups;
    __m256 acc[H][MB];
    for (int j = 0; j < H; j++)
        for (int m = 0; m < MB; m++) acc[j][m] = _mm256_setzero_ps();
    for (size_t g = 0; g < groups; g++, q += Q * STORED<BITS> * 8, x4 += Q, d++, xc++, xsum++) {
        if (!PREP) prefetch_ahead<BITS, Q>(w, q);
        __m256i s[C][H][MB], p[C][H][MB];
        for (int i = 0; i < C; i++)
            for (int j = 0; j < H; j++)
                for (int m = 0; m < MB; m++) s[i][j][m] = p[i][j][m] = _mm256_setzero_si256();
        const int32_t* xr[MB][P];  // a pointer each: as offsets from one, GCC kept 26 of them on the stack
        for (int m = 0; m < MB; m++)
            for (int pl = 0; pl < P; pl++) xr[m][pl] = x4 + m * row + pl * w.k / 4;
#pragma GCC unroll 8
        for (int c = 0; c < Q / 2; c++) {
            __m256i u[H][2];
            for (int j = 0; j < H; j++) {
                if constexpr (UNPACKED<BITS> && PREP) {
                    u[j][0] = f->bytes[f->at(g, c, h0 + j)];
                    u[j][1] = f->bytes[f->at(g, c + Q / 2, h0 + j)];
                } else {
                    unpack<BITS, Q>(q, c, h0 + j, u[j][0], u[j][1]);
                }
            }
            for (int half = 0; half < 2; half++)
                for (int m = 0; m < MB; m++)
                    for (int pl = 0; pl < P; pl++) {
                        const int i = P == 2 ? pl : (C == 2 ? half : 0);
                        const __m256i xb = _mm256_set1_epi32(xr[m][pl][c + half * Q / 2]);
                        for (int j = 0; j < H; j++) dot<BITS>(u[j][half], xb, s[i][j][m], p[i][j][m]);
                    }
            if constexpr (!WIDE<BITS>) {
                if ((c + 1) % PAIRS16<BITS> == 0 || c == Q / 2 - 1)  // widen before 16 bits overflow
                    for (int i = 0; i < C; i++)
                        for (int j = 0; j < H; j++)
                            for (int m = 0; m < MB; m++) {
                                s[i][j][m] = _mm256_add_epi32(s[i][j][m], _mm256_madd_epi16(p[i][j][m], _mm256_set1_epi16(1)));
                                p[i][j][m] = _mm256_setzero_si256();
                            }
            }
        }
        for (int j = 0; j < H; j++) {
            __m256 scale, offset;
            if constexpr (PREP) {
                scale = _mm256_loadu_ps(f->scale + g * 16 + 8 * (h0 + j));
                offset = OFF ? _mm256_loadu_ps(f->offset + g * 16 + 8 * (h0 + j)) : _mm256_setzero_ps();
            } else {
                group_floats(w, t, g, groups, h0 + j, scale, offset);
            }
            for (int m = 0; m < MB; m++) {
                __m256i sum = P == 2 ? _mm256_add_epi32(_mm256_slli_epi32(s[0][j][m], 8), s[1][j][m])
                                     : (C == 2 ? _mm256_add_epi32(s[0][j][m], s[1][j][m]) : s[0][j][m]);
                sum = _mm256_add_epi32(sum, _mm256_set1_epi32(xc[m * groups]));
                acc[j][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(d[m * groups])), acc[j][m]);
                if constexpr (OFF) acc[j][m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[m * groups]), acc[j][m]);
            }
        }
    }
    for (int j = 0; j < H; j++)
        for (int m = 0; m < MB; m++) store(y, t, m0 + m, h0 + j, acc[j][m]);
}

// Rows of x in blocks of MB (then 2, then 1), a half tile at a time.
template <int MB, int BITS, int Q, int P, bool OFF, bool PREP>
void halves(const Weights& w, const Activations& a, const TileFloats<BITS, Q>* f, size_t rows, size_t t, const Outputs& y) {
    for (int h = 0; h < 2; h++) {
        size_t m = 0;
        for (; m + MB <= rows; m += MB) half_kernel<MB, 1, BITS, Q, P, OFF, PREP>(w, a, f, m, t, h, y);
        if (m + 2 <= rows) { half_kernel<2, 1, BITS, Q, P, OFF, PREP>(w, a, f, m, t, h, y); m += 2; }
        if (m < rows) half_kernel<1, 1, BITS, Q, P, OFF, PREP>(w, a, f, m, t, h, y);
    }
}

// Tile t (and t + 1 with `pair`) against every row of x. One or two rows (one of two planes)
// take both halves at once, as the 16 ymm registers hold them; more take a half at a time in
// blocks, from PAIR_ROWS rows over the tile's floats prepared once.
template <int BITS, int Q, int P, bool OFF>
void tiles(const Weights& w, const Activations& a, size_t rows, size_t t, bool pair, const Outputs& y) {
    constexpr int MB = P == 2 ? 3 : 4;
    for (size_t u = t; u < t + (pair ? 2 : 1); u++) {
        if (rows >= PAIR_ROWS) {
            const TileFloats<BITS, Q> f(w, u);
            halves<MB, BITS, Q, P, OFF, true>(w, a, &f, rows, u, y);
        } else if (rows > 2 / P) {
            halves<MB, BITS, Q, P, OFF, false>(w, a, nullptr, rows, u, y);
        } else if (rows == 2) {
            half_kernel<2, 2, BITS, Q, P, OFF, false>(w, a, nullptr, 0, u, 0, y);
        } else {
            half_kernel<1, 2, BITS, Q, P, OFF, false>(w, a, nullptr, 0, u, 0, y);
        }
    }
}

template <int BITS, int Q, int P>
void run_tile(const Weights& w, const Activations& a, size_t rows, size_t t, bool pair, const Outputs& y) {
    (w.offset ? tiles<BITS, Q, P, true> : tiles<BITS, Q, P, false>)(w, a, rows, t, pair, y);
}

}  // namespace
}  // namespace vinoserve
