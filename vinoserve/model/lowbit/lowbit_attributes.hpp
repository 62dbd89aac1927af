// The attributes LowBitMatMul and LowBitExperts share: how the weights are laid out and how x is
// quantized (lowbit_layout.hpp says what each means), and the Weights they make of the inputs.
// Included after lowbit_multiply.hpp (its `pick`).
#pragma once

#include <cstdint>

#include <openvino/core/attribute_visitor.hpp>
#include <openvino/core/node.hpp>
#include <openvino/runtime/tensor.hpp>

#include "lowbit_layout.hpp"

namespace vinoserve {
namespace {

struct WeightAttributes {
    // n: the matrix's rows (LowBitExperts: one expert's); planes: x in 1 or 2 int8 planes, or 0:
    // as many as the op's last input says; prefetch: how far ahead the weights are fetched, bytes
    int64_t n = 0, k = 0, bits = 4, group = 32, bias = 0, block = 0, centre = 0, factor_bits = 8, planes = 1, prefetch = 1024;
    int64_t e2m1 = 0;  // 1: 4-bit E2M1 codes (MXFP4's, lowbit_layout.hpp), not integers

    void visit(ov::AttributeVisitor& v) {
        v.on_attribute("n", n);
        v.on_attribute("k", k);
        v.on_attribute("bits", bits);
        v.on_attribute("group", group);
        v.on_attribute("bias", bias);
        v.on_attribute("block", block);
        v.on_attribute("centre", centre);
        v.on_attribute("factor_bits", factor_bits);
        v.on_attribute("planes", planes);
        v.on_attribute("prefetch", prefetch);
        v.on_attribute("e2m1", e2m1);
    }

    // The attributes, and the inputs from the scales on: `scales` (then offsets where `floats` is 2),
    // and the planes input last where planes is 0.
    void check(const ov::Node* node, size_t scales_input, size_t floats) const {
        const auto scales = node->get_input_element_type(scales_input);
        NODE_VALIDATION_CHECK(node, floats == 1 || floats == 2, "weights, scales [, offsets] after x");
        NODE_VALIDATION_CHECK(node, scales == ov::element::u8 || (!block && scales == ov::element::f32),
                              "scales are f32, or bytes: f16s or (block > 0) their factors");
        NODE_VALIDATION_CHECK(node, floats == 1 || node->get_input_element_type(scales_input + 1) == scales,
                              "offsets are of the scales' type");
        NODE_VALIDATION_CHECK(node, planes != 0 || node->get_input_element_type(node->get_input_size() - 1) == ov::element::i32,
                              "planes is an i32 input");
        NODE_VALIDATION_CHECK(node, pick(bits, group, 1, e2m1) != nullptr, "unsupported bits/group ", bits, "/", group,
                              e2m1 ? " for E2M1 codes" : "");
        NODE_VALIDATION_CHECK(node, k % group == 0, "k is not a multiple of the group");
        NODE_VALIDATION_CHECK(node, block == 0 || (block_shift() >= 0 && (k / group) % block == 0),
                              "block is not a power of two dividing the groups");
        NODE_VALIDATION_CHECK(node, factor_bits == 8 || (factor_bits == 6 && block), "factor_bits is 8, or 6 with block");
        NODE_VALIDATION_CHECK(node, planes >= 0 && planes <= 2, "planes is 1, 2 or 0 (an input)");
        NODE_VALIDATION_CHECK(node, prefetch >= 0 && prefetch <= 65536, "prefetch is a distance in bytes, up to 64 KiB");
    }

    int block_shift() const {  // log2 of block, -1 for none (or not a power of two)
        for (int s = 0; s < 31; s++)
            if ((int64_t{1} << s) == block) return s;
        return -1;
    }

    // The weights at q, with the scales and (or nullptr) offsets.
    Weights weights(const ov::Tensor& q, const ov::Tensor& scale, const ov::Tensor* offset) const {
        return {static_cast<const uint8_t*>(q.data()), scale.data(), offset ? offset->data() : nullptr,
                scale.get_element_type() == ov::element::u8, static_cast<int>(bits), static_cast<int>(group),
                static_cast<int>(bias), static_cast<float>(centre), block_shift(), static_cast<int>(factor_bits),
                static_cast<size_t>(n), static_cast<size_t>(k), static_cast<size_t>(prefetch), e2m1 != 0};
    }

    // How many int8 planes x takes this call: the attribute's, or the planes input's (the last).
    int planes_now(const ov::TensorVector& inputs) const {
        return (planes ? planes : inputs.back().data<const int32_t>()[0]) == 2 ? 2 : 1;
    }
};

}  // namespace
}  // namespace vinoserve
