// vinoserve::LowBitMatMul, an OpenVINO extension op: y[m, n] = sum_k x[m, k] * w[n, k] for 4-, 6- or
// 8-bit weights in groups along k: the decode model's steps (AMX CPUs), or every product of the
// one compilation, prompts included (AVX512_BF16 CPUs without AMX; cpu_defaults.py). Its
// arithmetic and weight layout: lowbit_layout.hpp; its kernels, one file an instruction set:
// lowbit_kernels_avx512.hpp (AVX-512 VNNI), lowbit_kernels_avx2.hpp (AVX2, and AVX-VNNI where the CPU has it).
//
// Why: the CPU plugin's int8-activation kernel for compressed weights runs a one-token product at
// about 48 ps a 4-bit weight on a 2-core Emerald Rapids, well below what the cores read from memory
// (its own f32 gemv streams 21 GB/s); this one reads the packed weights once and runs at the memory's
// pace (vinoserve/model/lowbit/__init__.py has the figures).
//
// Attributes: n, k, bits (4, 5, 6 or 8; 5 with groups of 32), group (16 or 32), bias (what makes a
// weight unsigned), block, centre and factor_bits (K-quants' factored scales), planes: x quantized
// to 1 or 2 int8 planes, or 0: as many as the last input says, a scalar the runner sets each step
// (engine/model_runner.py, ModelRunner.planes); prefetch: how far ahead the weights are fetched,
// in bytes; parts: the outputs' widths where the product is split along its columns (whole tiles;
// empty: one output); sampled (with the planes input): 1 where the input before it lists the rows
// of x whose logits the step reads (paged.SAMPLED_INDICES): in a step of two planes only those
// take two, the others one (the MLP's gate and up products: a prompt step 0.80x the time, the
// first reply token as near f32's; rewrite.py).
#include <cstdint>
#include <vector>

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>

#include "lowbit_gather.hpp"
// One instruction set's path a library (build.py builds one per path, with its compiler flags)
#if defined(VINOSERVE_LOWBIT_AVX2)
#include "lowbit_kernels_avx2.hpp"
#else
#include "lowbit_kernels_avx512.hpp"
#endif
#include "lowbit_multiply.hpp"
#include "lowbit_attributes.hpp"
#include "lowbit_experts.hpp"

namespace vinoserve {
class LowBitMatMul : public ov::op::Op {
public:
    OPENVINO_OP("LowBitMatMul", "vinoserve");

    LowBitMatMul() = default;

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, m_sampled == 0 || m_sampled == 1, "sampled is 0 or 1");
        m_w.check(this, 2, float_inputs());  // x, weights, scales [, offsets] [, sampled] [, planes]
        // i64 as the graph gives them, i32 as the plugin's precision pass may leave them
        NODE_VALIDATION_CHECK(this, m_sampled == 0 || (m_w.planes == 0 && (get_input_element_type(sampled_input()) == ov::element::i64 ||
                                                                         get_input_element_type(sampled_input()) == ov::element::i32)),
                              "sampled goes with the planes input, the sampled rows' indices before it");
        auto shape = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, shape.rank().is_static() && shape[shape.size() - 1].compatible(m_w.k), "x's last dimension is not k");
        const std::vector<int64_t> parts = this->parts();
        int64_t total = 0;
        for (const int64_t n : parts) {
            NODE_VALIDATION_CHECK(this, n > 0 && (parts.size() == 1 || n % 16 == 0), "parts are whole tiles of 16 columns");
            total += n;
        }
        NODE_VALIDATION_CHECK(this, total == m_w.n && parts.size() <= Outputs::MAX, "up to 4 parts, summing to n");
        for (size_t i = 0; i < parts.size(); i++) {
            shape[shape.size() - 1] = parts[i];
            set_output_type(i, ov::element::f32, shape);
        }
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        auto op = std::make_shared<LowBitMatMul>();
        op->set_arguments(args);
        op->m_w = m_w; op->m_parts = m_parts; op->m_sampled = m_sampled;
        op->constructor_validate_and_infer_types();
        return op;
    }

    bool visit_attributes(ov::AttributeVisitor& v) override {
        m_w.visit(v);
        v.on_attribute("parts", m_parts);
        v.on_attribute("sampled", m_sampled);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Shape xs = inputs[0].get_shape();
        const std::vector<int64_t> parts = this->parts();
        Outputs y{{}, {}, {}, static_cast<int>(parts.size())};
        for (size_t i = 0, tile = 0; i < parts.size(); tile += parts[i] / 16, i++) {
            ov::Shape ys = xs;
            ys.back() = parts[i];
            outputs[i].set_shape(ys);
            y.data[i] = outputs[i].data<float>();
            y.n[i] = parts[i];
            y.first_tile[i] = tile;
        }
        const size_t rows = ov::shape_size(xs) / m_w.k;
        if (rows == 0) return true;
        const Weights w = m_w.weights(inputs[1], inputs[2], float_inputs() == 2 ? &inputs[3] : nullptr);
        const int planes = m_w.planes_now(inputs);
        const float* x = inputs[0].data<float>();
        std::vector<RowSet> sets;
        std::vector<size_t> fine, coarse;
        if (m_sampled && planes == 2) split_rows(inputs[sampled_input()], rows, fine, coarse);
        if (!fine.empty() && !coarse.empty()) {
            sets.push_back(row_set(x, w, rows, 1, std::move(coarse), y));
            sets.push_back(row_set(x, w, rows, 2, std::move(fine), y));
        } else {  // every row alike: at `planes`, or at one where none is listed
            sets.push_back(row_set(x, w, rows, coarse.empty() ? planes : 1, {}, y));
        }
        multiply(w, sets);
        return true;
    }

private:
    size_t float_inputs() const { return get_input_size() - 2 - (m_w.planes == 0) - m_sampled; }  // scales [, offsets]

    size_t sampled_input() const { return get_input_size() - 2; }

    // The rows `listed` (those in range, once each), and the others, in order.
    static void split_rows(const ov::Tensor& listed, size_t rows, std::vector<size_t>& fine, std::vector<size_t>& coarse) {
        std::vector<char> is_fine(rows, 0);
        for (size_t i = 0; i < listed.get_size(); i++) {
            const int64_t r = listed.get_element_type() == ov::element::i64 ? listed.data<const int64_t>()[i]
                                                                            : listed.data<const int32_t>()[i];
            if (r >= 0 && static_cast<size_t>(r) < rows) is_fine[r] = 1;
        }
        for (size_t r = 0; r < rows; r++) (is_fine[r] ? fine : coarse).push_back(r);
    }

    std::vector<int64_t> parts() const { return m_parts.empty() ? std::vector<int64_t>{m_w.n} : m_parts; }

    WeightAttributes m_w;
    int64_t m_sampled = 0;
    std::vector<int64_t> m_parts;  // the outputs' columns, in tiles' order; empty: one output of n
};

}  // namespace vinoserve

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<vinoserve::LowBitMatMul>>(),
                                                            std::make_shared<ov::OpExtension<vinoserve::LowBitGather>>(),
                                                            std::make_shared<ov::OpExtension<vinoserve::LowBitExperts>>()}));
