// vinoserve::LowBitMatMul, an OpenVINO extension op: y[m, n] = sum_k x[m, k] * w[n, k] for 4-, 6- or
// 8-bit weights in groups along k: the decode model's steps (AMX CPUs), or every product of the
// one compilation, prompts included (AVX512_BF16 CPUs without AMX; cpu_defaults.py).
//
// Why: the CPU plugin's int8-activation kernel for compressed weights runs a one-token product at
// about 48 ps a 4-bit weight on a 2-core Emerald Rapids, well below what the cores read from memory
// (its own f32 gemv streams 21 GB/s); this one reads the packed weights once and runs at the memory's
// pace (vinoserve/model/lowbit/__init__.py has the figures).
//
// Arithmetic, as llama.cpp's q8 dot products: each row of x is quantized to int8 per group of the
// weights (scale amax / 127), the integer dot products are exact in int32 (VNNI), and per group
//     y += (sum_i u_i * xq_i - bias * sum_i xq_i) * scale * xd (+ offset * sum_i x_i)
// where u = q + bias is the weight made unsigned (bias 8 for i4, 128 for i8, 0 for unsigned types).
// With the attribute `planes` 2, each row of x is two int8 rows: its rounding and the rounding of
// what that left, summed as two rows' products (see quantize); 1: one; 0: as many as the last
// input says, a scalar the runner sets each step (engine/model_runner.py, ModelRunner.planes).
// The offset (a block's minimum, Q4_1 / Q4_K) multiplies the exact sum of the group's inputs, not
// of their int8 roundings (llama.cpp's q8_1 sum): with the rounded sums the built-in Q4_1 model's
// long-context perplexity was 1.015x f32's, with exact ones 0.992x (the plugin's correction
// product, which this replaces, reads exact sums too).
//
// Weight layout (written by pack.py): rows in tiles of 16, per tile and group the bytes one
// vpdpbusd reads: chunk c holds, for each of the 16 rows, 4 consecutive weights (64 bytes).
// 8-bit: chunk c = weights 4c..4c+3 of the group. 4-bit: the low nibbles of chunk c are weights
// 4c..4c+3 and the high nibbles weights 4(c + H)..4(c + H)+3, H = group / 8. 6-bit (Q6_K's
// values, 0.75 bytes a weight where 8 bits took 1): their low four bits as the 4-bit layout, then
// the top two in 64-byte planes, chunk c's at bits 2(c % 4) of plane c / 4.
// Scales (and offsets) per tile and group: 16 floats (f16 or f32), one per row; or, where the
// attribute `block` > 0 (K-quants), factored as the file stores them, in bytes (the plugin would
// widen an f16 constant): per tile and block of `block` groups 16 f16s, then per group 16 int8s;
// scale = f16 * int8, exact in f32. An offset's factors are the block minimum's, o; the kernel
// adds back centre * scale, the centring weights.py applied (8 for Q4_K, 16 for Q5_K), rounded
// once as numpy's f32 sum was: offset = fma(scale, centre, o). 0.58 bytes a Q4_K weight instead
// of 0.75, 1.07 a Q6_K one instead of 1.25.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

namespace vinoserve {
namespace {

// x quantized per group: int8 values, a scale and the integer sum per group. In two planes a
// group is d1 q1 + d1 / 256 q2: one integer 256 q1 + q2 at scale d1 / 256, so `d` and `s` are per
// row of x and group in either case (s: of that integer).
struct Activations {
    std::vector<int8_t> q;  // per row of x, `planes` rows: its int8s, then those of what they left
    std::vector<float> d;
    std::vector<int32_t> s;
    std::vector<float> sum;  // per row of x, the group's inputs summed as they are
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

// Each row of x as `planes` int8 rows per group: the first its values', a second (planes 2) what
// the first's rounding left, at a scale 256 times finer (x = d1 q1 + d1 / 256 q2 to ~2^-16 of the
// group's largest value: closer to f32 than bf16's 2^-9, for twice the dot products). Buffers of
// its own per call (a few KiB): a thread waiting in parallel_for may run another node's call, so
// a thread's buffer could be rewritten under its readers.
Activations quantize(const float* x, size_t rows, size_t k, size_t group, int planes) {
    const size_t groups = k / group;
    Activations a{std::vector<int8_t>(rows * planes * k), std::vector<float>(rows * groups),
                  std::vector<int32_t>(rows * groups), std::vector<float>(rows * groups)};
    float rest[32];
    for (size_t r = 0; r < rows; r++) {
        for (size_t g = 0; g < groups; g++) {
            const float* v = x + r * k + g * group;
            const size_t at = r * groups + g;
            __m512 total = _mm512_setzero_ps();
            for (size_t i = 0; i < group; i += 16) total = _mm512_add_ps(total, _mm512_loadu_ps(v + i));
            a.sum[at] = _mm512_reduce_add_ps(total);
            int8_t* q = a.q.data() + r * planes * k + g * group;
            quantize_group(v, group, q, a.d[at], a.s[at], planes == 2 ? rest : nullptr);
            if (planes == 2) {
                a.s[at] = FINE * a.s[at] + quantize_rest(rest, group, a.d[at], q + k);
                a.d[at] /= FINE;
            }
        }
    }
    return a;
}

struct Weights {
    const uint8_t* q;
    const void* scale;   // plain: f16 or f32 per group; factored: bytes as above
    const void* offset;  // nullptr: none
    bool f16;
    int bits, group, bias, centre, block_shift;  // block_shift < 0: plain floats
    size_t n, k;
    size_t tile_bytes() const { return 16 * k * bits / 8; }
};

inline __m512 load_half(const void* p, size_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
}

inline __m512 load_floats(const void* p, bool f16, size_t i) {
    return f16 ? load_half(p, i) : _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

// Factored: the f16s of group g's block times g's int8s (g counted over all tiles).
inline __m512 load_factored(const void* p, size_t g, int block_shift) {
    const size_t block = size_t{1} << block_shift;
    const uint8_t* at = static_cast<const uint8_t*>(p) + (g >> block_shift) * (32 + 16 * block);
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 32 + 16 * (g & (block - 1))))));
    return _mm512_mul_ps(load_half(at, 0), q);
}

// A tile's 16 scales and offsets of group g (groups: the row's).
inline void group_floats(const Weights& w, size_t t, size_t g, size_t groups, __m512& scale, __m512& offset) {
    const size_t at = t * groups + g;
    if (w.block_shift < 0) {
        scale = load_floats(w.scale, w.f16, at * 16);
        offset = w.offset ? load_floats(w.offset, w.f16, at * 16) : _mm512_setzero_ps();
        return;
    }
    scale = load_factored(w.scale, at, w.block_shift);
    offset = w.offset ? _mm512_fmadd_ps(scale, _mm512_set1_ps(static_cast<float>(w.centre)),
                                        load_factored(w.offset, at, w.block_shift))
                      : _mm512_setzero_ps();
}

// NT tiles of 16 rows (t, t + 1, ...) against MB rows of x, starting at x row m0. Q = weights a
// group / 4; P: planes a row of x was quantized to. Two tiles share each broadcast of x.
template <int MB, int BITS, int Q, int P, int NT>
void tile_kernel(const Weights& w, const Activations& a, size_t m0, size_t t, float* y, size_t y_stride) {
    const size_t groups = w.k / (4 * Q);
    const uint8_t* q[NT];
    for (int j = 0; j < NT; j++) q[j] = w.q + (t + j) * w.tile_bytes();
    __m512 acc[NT][MB];
    for (int j = 0; j < NT; j++)
        for (int m = 0; m < MB; m++) acc[j][m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    // two chains of dot products a tile where one tile is: one is latency-bound at one row of x
    // (a 1.5B step 0.92x the time); with two planes, a chain each
    constexpr int C = NT == 1 || P == 2 ? 2 : 1;
    for (size_t g = 0; g < groups; g++) {
        __m512i u[NT][Q];
        __m512 scale[NT], offset[NT];
        for (int j = 0; j < NT; j++) {
            // the weights 4 groups ahead (the tiles a thread runs lie end to end): a 1.5B step 0.8-0.95x
            // the time with the hardware's prefetching alone
            for (int l = 0; l < Q * BITS / 4; l++) _mm_prefetch(reinterpret_cast<const char*>(q[j]) + 1024 + 64 * l, _MM_HINT_T0);
            if constexpr (BITS == 4 || BITS == 6) {
                for (int c = 0; c < Q / 2; c++) {
                    const __m512i v = _mm512_loadu_si512(q[j] + c * 64);
                    u[j][c] = _mm512_and_si512(v, low);
                    u[j][c + Q / 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
                if constexpr (BITS == 6) {  // each chunk's top two bits, four chunks a 64-byte plane
                    const __m512i three = _mm512_set1_epi8(0x03);
                    for (int c = 0; c < Q; c++) {
                        const __m512i h = _mm512_loadu_si512(q[j] + Q * 32 + c / 4 * 64);
                        const __m512i top = _mm512_and_si512(_mm512_srli_epi16(h, 2 * (c % 4)), three);
                        u[j][c] = _mm512_or_si512(u[j][c], _mm512_slli_epi16(top, 4));
                    }
                }
                q[j] += Q * BITS * 8;
            } else {
                for (int c = 0; c < Q; c++) u[j][c] = _mm512_loadu_si512(q[j] + c * 64);
                q[j] += Q * 64;
            }
            group_floats(w, t + j, g, groups, scale[j], offset[j]);
        }
        for (int m = 0; m < MB; m++) {
            const size_t row = m0 + m, ag = row * groups + g;
            const int32_t* x4 = reinterpret_cast<const int32_t*>(a.q.data() + row * P * w.k + g * 4 * Q);
            __m512i s[NT][C];  // two planes: chain 0 the first's, chain 1 the second's (and the bias)
            for (int j = 0; j < NT; j++) {
                s[j][C - 1] = _mm512_set1_epi32(-w.bias * a.s[ag]);
                if constexpr (C == 2) s[j][0] = _mm512_setzero_si512();
            }
            for (int c = 0; c < Q; c++) {
                const __m512i xb = _mm512_set1_epi32(x4[c]);
                for (int j = 0; j < NT; j++) {
                    const int i = P == 2 ? 0 : c % C;
                    s[j][i] = _mm512_dpbusd_epi32(s[j][i], u[j][c], xb);
                }
            }
            if constexpr (P == 2) {
                const int32_t* fine4 = x4 + w.k / 4;
                for (int c = 0; c < Q; c++) {
                    const __m512i xb = _mm512_set1_epi32(fine4[c]);
                    for (int j = 0; j < NT; j++) s[j][1] = _mm512_dpbusd_epi32(s[j][1], u[j][c], xb);
                }
            }
            const __m512 d = _mm512_set1_ps(a.d[ag]);
            for (int j = 0; j < NT; j++) {
                if constexpr (P == 2) s[j][0] = _mm512_add_epi32(_mm512_slli_epi32(s[j][0], 8), s[j][1]);
                else if constexpr (C == 2) s[j][0] = _mm512_add_epi32(s[j][1], s[j][0]);
                acc[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j][0]), _mm512_mul_ps(scale[j], d), acc[j][m]);
            }
            if (w.offset) {
                const __m512 sum = _mm512_set1_ps(a.sum[row * groups + g]);
                for (int j = 0; j < NT; j++) acc[j][m] = _mm512_fmadd_ps(offset[j], sum, acc[j][m]);
            }
        }
    }
    for (int j = 0; j < NT; j++) {
        const size_t n0 = (t + j) * 16, live = std::min<size_t>(16, w.n - n0);
        const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
        for (int m = 0; m < MB; m++) _mm512_mask_storeu_ps(y + (m0 + m) * y_stride + n0, mask, acc[j][m]);
    }
}

// Tiles t, t + 1 (pair) or t alone against every row of x.
template <int BITS, int Q, int P>
void run_tile(const Weights& w, const Activations& a, size_t rows, size_t t, bool pair, float* y) {
    size_t m = 0;
    if (pair) {
        // rows a call: two tiles' MB accumulators beside their weights in the 32 registers (two
        // planes spilled at 4: [8,960 x 1,536] Q4_0 at 256 rows 0.92x the time at 3, Zen 5)
        constexpr int MB = P == 2 ? 3 : 4;
        for (; m + MB <= rows; m += MB) tile_kernel<MB, BITS, Q, P, 2>(w, a, m, t, y, w.n);
        if (m + 2 <= rows) { tile_kernel<2, BITS, Q, P, 2>(w, a, m, t, y, w.n); m += 2; }
        if (m < rows) tile_kernel<1, BITS, Q, P, 2>(w, a, m, t, y, w.n);
        return;
    }
    for (; m + 8 <= rows; m += 8) tile_kernel<8, BITS, Q, P, 1>(w, a, m, t, y, w.n);
    if (m + 4 <= rows) { tile_kernel<4, BITS, Q, P, 1>(w, a, m, t, y, w.n); m += 4; }
    if (m + 2 <= rows) { tile_kernel<2, BITS, Q, P, 1>(w, a, m, t, y, w.n); m += 2; }
    if (m < rows) tile_kernel<1, BITS, Q, P, 1>(w, a, m, t, y, w.n);
}

constexpr size_t PAIR_ROWS = 8;

using TileFn = void (*)(const Weights&, const Activations&, size_t, size_t, bool, float*);

template <int P>
TileFn pick_planes(int bits, int group) {
    if (bits == 4 && group == 32) return run_tile<4, 8, P>;
    if (bits == 4 && group == 16) return run_tile<4, 4, P>;
    if (bits == 6 && group == 32) return run_tile<6, 8, P>;
    if (bits == 6 && group == 16) return run_tile<6, 4, P>;
    if (bits == 8 && group == 32) return run_tile<8, 8, P>;
    if (bits == 8 && group == 16) return run_tile<8, 4, P>;
    return nullptr;
}

TileFn pick(int bits, int group, int planes) {
    return planes == 1 ? pick_planes<1>(bits, group) : planes == 2 ? pick_planes<2>(bits, group) : nullptr;
}

}  // namespace

class LowBitMatMul : public ov::op::Op {
public:
    OPENVINO_OP("LowBitMatMul", "vinoserve");

    LowBitMatMul() = default;

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, pick(m_bits, m_group, 1) != nullptr, "unsupported bits/group ", m_bits, "/", m_group);
        NODE_VALIDATION_CHECK(this, m_k % m_group == 0, "k is not a multiple of the group");
        NODE_VALIDATION_CHECK(this, m_block == 0 || (block_shift() >= 0 && (m_k / m_group) % m_block == 0),
                              "block is not a power of two dividing the groups");
        NODE_VALIDATION_CHECK(this, m_planes >= 0 && m_planes <= 2, "planes is 1, 2 or 0 (an input)");
        NODE_VALIDATION_CHECK(this, float_inputs() == 1 || float_inputs() == 2, "x, weights, scales [, offsets] [, planes]");
        NODE_VALIDATION_CHECK(this, m_planes != 0 || get_input_element_type(get_input_size() - 1) == ov::element::i32,
                              "planes is an i32 input");
        NODE_VALIDATION_CHECK(this, !m_block || get_input_element_type(2) == ov::element::u8, "factored scales are bytes");
        auto shape = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, shape.rank().is_static() && shape[shape.size() - 1].compatible(m_k), "x's last dimension is not k");
        shape[shape.size() - 1] = static_cast<int64_t>(m_n);
        set_output_type(0, ov::element::f32, shape);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        auto op = std::make_shared<LowBitMatMul>();
        op->set_arguments(args);
        op->m_n = m_n; op->m_k = m_k; op->m_bits = m_bits; op->m_group = m_group; op->m_bias = m_bias; op->m_block = m_block; op->m_centre = m_centre;
        op->m_planes = m_planes;
        op->constructor_validate_and_infer_types();
        return op;
    }

    bool visit_attributes(ov::AttributeVisitor& v) override {
        v.on_attribute("n", m_n);
        v.on_attribute("k", m_k);
        v.on_attribute("bits", m_bits);
        v.on_attribute("group", m_group);
        v.on_attribute("bias", m_bias);
        v.on_attribute("block", m_block);
        v.on_attribute("centre", m_centre);
        v.on_attribute("planes", m_planes);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Shape xs = inputs[0].get_shape();
        ov::Shape ys = xs;
        ys.back() = m_n;
        outputs[0].set_shape(ys);
        const size_t rows = ov::shape_size(xs) / m_k;
        float* y = outputs[0].data<float>();
        if (rows == 0) return true;
        Weights w{static_cast<const uint8_t*>(inputs[1].data()), inputs[2].data(),
                  float_inputs() == 2 ? inputs[3].data() : nullptr, inputs[2].get_element_type() == ov::element::f16,
                  static_cast<int>(m_bits), static_cast<int>(m_group), static_cast<int>(m_bias), static_cast<int>(m_centre), block_shift(),
                  static_cast<size_t>(m_n), static_cast<size_t>(m_k)};
        const int planes = (m_planes ? m_planes : inputs.back().data<const int32_t>()[0]) == 2 ? 2 : 1;
        const Activations a = quantize(inputs[0].data<float>(), rows, w.k, w.group, planes);
        const TileFn fn = pick(w.bits, w.group, planes);
        const size_t tiles = (w.n + 15) / 16;
        // Tiles in pairs from PAIR_ROWS rows of x, sharing each broadcast of x (Zen 5, [8,960 x
        // 1,536] Q4_0 at 256 rows: 0.9x the time; 16 rows 0.85x)
        const size_t step = rows >= PAIR_ROWS ? 2 : 1, units = (tiles + step - 1) / step;
        // One contiguous share of the tiles a thread: the rows are equal work, and a step's
        // ~200 calls each pay the split.
        tbb::parallel_for(tbb::blocked_range<size_t>(0, units), [&](const tbb::blocked_range<size_t>& r) {
            for (size_t i = r.begin(); i != r.end(); i++) fn(w, a, rows, i * step, step == 2 && i * step + 1 < tiles, y);
        }, tbb::static_partitioner());
        return true;
    }

private:
    size_t float_inputs() const { return get_input_size() - 2 - (m_planes == 0); }  // scales [, offsets]

    int block_shift() const {  // log2 of block, -1 for none (or not a power of two)
        for (int s = 0; s < 31; s++)
            if ((int64_t{1} << s) == m_block) return s;
        return -1;
    }

    int64_t m_n = 0, m_k = 0, m_bits = 4, m_group = 32, m_bias = 0, m_block = 0, m_centre = 0, m_planes = 1;
};

}  // namespace vinoserve

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<vinoserve::LowBitMatMul>>()}));
