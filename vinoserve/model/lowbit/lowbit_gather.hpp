// vinoserve::LowBitGather, an OpenVINO extension op: rows of a low-bit token table, decompressed
// to f32 as weights.py's chain writes them: y[..., j] = v[id, j] * scale[id, j / group]
// (+ offset[id, j / group]), v the table's 4- or 8-bit integer, in f32 as llama.cpp's get_rows.
//
// Why: the CPU plugin runs a Gather from grouped low-bit constants on its reference code
// ("GatherCompressed ref_any_i4"): 0.47 ms of a 19.6 ms one-token step of a 1.5B Q4_0 model,
// 0.63 ms of Q4_K_M's (Zen 5), for one row of 1,536 values. This reads the one row.
//
// Inputs: ids (i32 or i64, any shape); the table's integers as bytes, [rows, k * bits / 8] (4-bit:
// values 2j and 2j + 1 in the low and high nibble of byte j, OpenVINO's packing); scales, a float
// per row and group: f32, or f16s as bytes (u8, two a scale); optionally offsets of the scales'
// type. Bytes because the plugin would widen a 4-bit input to int8 and an f16 one to f32.
// Attributes: k, bits (4 or 8), group, is_signed.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include <openvino/op/op.hpp>
#include <tbb/parallel_for.h>

namespace vinoserve {

class LowBitGather : public ov::op::Op {
public:
    OPENVINO_OP("LowBitGather", "vinoserve");

    LowBitGather() = default;

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, m_bits == 4 || m_bits == 8, "bits is 4 or 8");
        NODE_VALIDATION_CHECK(this, m_group > 0 && m_group % 2 == 0 && m_k % m_group == 0, "k is not a multiple of an even group");
        NODE_VALIDATION_CHECK(this, get_input_size() == 3 || get_input_size() == 4, "ids, table, scales [, offsets]");
        const auto ids = get_input_element_type(0), scales = get_input_element_type(2);
        NODE_VALIDATION_CHECK(this, ids == ov::element::i32 || ids == ov::element::i64, "ids are i32 or i64");
        NODE_VALIDATION_CHECK(this, scales == ov::element::u8 || scales == ov::element::f32, "scales are f32, or f16s as bytes");
        NODE_VALIDATION_CHECK(this, get_input_size() == 3 || get_input_element_type(3) == scales, "offsets are of the scales' type");
        const auto& q = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, get_input_element_type(1) == ov::element::u8 && q.is_static() && q.size() == 2
                              && q[1].get_length() == m_k * m_bits / 8, "the table is bytes, [rows, k * bits / 8]");
        const int64_t floats = q[0].get_length() * (m_k / m_group) * (scales == ov::element::u8 ? 2 : 1);
        for (size_t i = 2; i < get_input_size(); i++)
            NODE_VALIDATION_CHECK(this, get_input_partial_shape(i).is_static()
                                  && static_cast<int64_t>(ov::shape_size(get_input_shape(i))) == floats, "a scale and offset a row and group");
        auto shape = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, shape.rank().is_static(), "ids have a static rank");
        shape.push_back(m_k);
        set_output_type(0, ov::element::f32, shape);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        auto op = std::make_shared<LowBitGather>();
        op->set_arguments(args);
        op->m_k = m_k; op->m_bits = m_bits; op->m_group = m_group; op->m_signed = m_signed;
        op->constructor_validate_and_infer_types();
        return op;
    }

    bool visit_attributes(ov::AttributeVisitor& v) override {
        v.on_attribute("k", m_k);
        v.on_attribute("bits", m_bits);
        v.on_attribute("group", m_group);
        v.on_attribute("is_signed", m_signed);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        ov::Shape ys = inputs[0].get_shape();
        const size_t count = ov::shape_size(ys), table_rows = inputs[1].get_shape()[0];
        ys.push_back(m_k);
        outputs[0].set_shape(ys);
        float* y = outputs[0].data<float>();
        for (size_t i = 0; i < count; i++) {  // all checked before a row is written
            const int64_t id = id_at(inputs[0], i);
            if (id < 0 || static_cast<size_t>(id) >= table_rows) OPENVINO_THROW("token id ", id, " is outside the table's ", table_rows, " rows");
        }
        auto rows = [&](size_t begin, size_t end) {
            for (size_t i = begin; i < end; i++) row(inputs, static_cast<size_t>(id_at(inputs[0], i)), y + i * m_k);
        };
        if (count < 16) rows(0, count);  // a decode step's one row: no threads to wake
        else tbb::parallel_for(tbb::blocked_range<size_t>(0, count), [&](const tbb::blocked_range<size_t>& r) { rows(r.begin(), r.end()); });
        return true;
    }

private:
    static int64_t id_at(const ov::Tensor& ids, size_t i) {
        return ids.get_element_type() == ov::element::i32 ? ids.data<const int32_t>()[i] : ids.data<const int64_t>()[i];
    }

    static float float_at(const ov::Tensor& t, size_t i) {
        if (t.get_element_type() == ov::element::f32) return t.data<const float>()[i];
        return _cvtsh_ss(reinterpret_cast<const uint16_t*>(t.data())[i]);
    }

    int value(const uint8_t* row, int64_t j) const {
        if (m_bits == 8) return m_signed ? static_cast<int8_t>(row[j]) : row[j];
        const int nibble = (row[j / 2] >> (4 * (j % 2))) & 0x0F;
        return m_signed ? nibble - ((nibble & 8) << 1) : nibble;
    }

    // q * scale, then + offset: rounded twice, as the graph's Multiply and Add are (the library
    // is built without fma contraction)
    void row(const ov::TensorVector& inputs, size_t r, float* out) const {
        const uint8_t* bytes = static_cast<const uint8_t*>(inputs[1].data()) + r * (m_k * m_bits / 8);
        const bool offsets = inputs.size() == 4;
        const size_t groups = m_k / m_group;
        for (size_t g = 0; g < groups; g++) {
            const float s = float_at(inputs[2], r * groups + g), o = offsets ? float_at(inputs[3], r * groups + g) : 0.0f;
            for (int64_t j = g * m_group; j < static_cast<int64_t>(g + 1) * m_group; j++) {
                const float w = static_cast<float>(value(bytes, j)) * s;
                out[j] = offsets ? w + o : w;
            }
        }
    }

    int64_t m_k = 0, m_bits = 4, m_group = 32;
    bool m_signed = true;
};

}  // namespace vinoserve
