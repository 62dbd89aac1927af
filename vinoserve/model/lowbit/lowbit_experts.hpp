// vinoserve::LowBitExperts, an OpenVINO extension op: a mixture of experts' products on the kernel
// (llama.cpp's mul_mat_id): rows of x sorted by expert, expert e's run of them (up to ends[e])
// times its own [n, k] low-bit matrix; experts no row was routed to are not read. It takes the
// place of a GroupedMatMul (opset 17) whose matrices are a decompression chain (model/moe.py).
//
// Why: the CPU plugin's GatherMatmul multiplies each (token, expert) pair on its own, at f32 6x
// below a dense product of the same FLOPs, and at bf16 pays ~40 ms a call for 64 experts; here an
// expert's rows share each read of its tiles, as a dense product's rows do.
//
// Inputs: x [rows, k] f32, ends [experts] i32 (GroupedMatMul's offsets: where each expert's rows
// end), then the weights, scales [, offsets] [, planes] as LowBitMatMul takes them, every expert's
// matrix stacked into one [experts * n, k] (n whole tiles of 16, so no tile holds two experts').
// Attributes: experts, and LowBitMatMul's n (one expert's rows), k, bits, group, bias, block,
// centre, factor_bits, planes, prefetch.
#pragma once

#include <cstdint>
#include <vector>

#include <openvino/op/op.hpp>
#include <tbb/parallel_for.h>

#include "lowbit_attributes.hpp"
#include "lowbit_multiply.hpp"

namespace vinoserve {
class LowBitExperts : public ov::op::Op {
public:
    OPENVINO_OP("LowBitExperts", "vinoserve");

    LowBitExperts() = default;

    void validate_and_infer_types() override {
        m_w.check(this, 3, float_inputs());  // x, ends, weights, scales [, offsets] [, planes]
        NODE_VALIDATION_CHECK(this, m_experts > 0 && m_w.n > 0 && m_w.n % 16 == 0, "n is whole tiles of 16 rows an expert");
        NODE_VALIDATION_CHECK(this, get_input_element_type(1) == ov::element::i32, "ends are i32");
        auto shape = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, shape.rank().is_static() && shape.size() == 2 && shape[1].compatible(m_w.k), "x is [rows, k]");
        shape[1] = m_w.n;
        set_output_type(0, ov::element::f32, shape);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        auto op = std::make_shared<LowBitExperts>();
        op->set_arguments(args);
        op->m_experts = m_experts; op->m_w = m_w;
        op->constructor_validate_and_infer_types();
        return op;
    }

    bool visit_attributes(ov::AttributeVisitor& v) override {
        v.on_attribute("experts", m_experts);
        m_w.visit(v);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const size_t rows = inputs[0].get_shape()[0];
        outputs[0].set_shape({rows, static_cast<size_t>(m_w.n)});
        if (rows == 0) return true;
        const Weights w = m_w.weights(inputs[2], inputs[3], float_inputs() == 2 ? &inputs[4] : nullptr);
        const int planes = m_w.planes_now(inputs);
        multiply_experts(w, inputs[0].data<const float>(), inputs[1].data<const int32_t>(), rows, planes, outputs[0].data<float>());
        return true;
    }

private:
    size_t float_inputs() const { return get_input_size() - 3 - (m_w.planes == 0); }  // scales [, offsets]

    // One expert's rows: its activations and where its tiles start among all experts'.
    struct Run {
        RowSet set;
        size_t first_tile;
    };

    void multiply_experts(const Weights& w, const float* x, const int32_t* ends, size_t rows, int planes, float* y) const {
        const size_t tiles = static_cast<size_t>(m_w.n) / 16;
        std::vector<Run> runs;
        for (size_t e = 0, start = 0; e < static_cast<size_t>(m_experts); e++) {
            const size_t end = std::min(rows, static_cast<size_t>(std::max(ends[e], 0)));
            if (end > start) {
                Outputs out{{y + start * m_w.n}, {static_cast<size_t>(m_w.n)}, {e * tiles}, 1};
                runs.push_back({row_set(x + start * m_w.k, w, end - start, planes, {}, out), e * tiles});
            }
            start = std::max(start, end);
        }
        // Units of a tile (a pair from PAIR_ROWS rows) of one expert, each stealable: experts' row
        // counts differ, so equal shares of units would not be equal work.
        std::vector<std::pair<uint32_t, uint32_t>> units;  // (run, tile within the expert)
        for (size_t r = 0; r < runs.size(); r++) {
            const size_t step = runs[r].set.rows >= PAIR_ROWS ? 2 : 1;
            for (size_t t = 0; t < tiles; t += step) units.emplace_back(static_cast<uint32_t>(r), static_cast<uint32_t>(t));
        }
        tbb::parallel_for(tbb::blocked_range<size_t>(0, units.size()), [&](const tbb::blocked_range<size_t>& range) {
            for (size_t i = range.begin(); i != range.end(); i++) {
                const Run& run = runs[units[i].first];
                const size_t t = units[i].second;
                const bool pair = run.set.rows >= PAIR_ROWS && t + 1 < tiles;
                run.set.fn(w, run.set.a, run.set.rows, run.first_tile + t, pair, run.set.y);
            }
        });
    }

    WeightAttributes m_w;
    int64_t m_experts = 0;
};

}  // namespace vinoserve
