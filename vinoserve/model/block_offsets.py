"""Load-time graph pass: a quantized block's minimum, moved out of the weight into a second product.

GGUF types with a minimum per block (Q4_1, Q5_1, Q4_K, Q5_K) decode as w = q * scale + offset,
and the converter writes exactly that (weights.py). The CPU plugin's compressed matmuls take Convert
-> [Subtract zero point] -> Multiply only. An f16 zero point (-offset / scale) is exact up to f16
rounding (under 1% of a step), but int8-activation kernels refuse it and one token's bf16 kernels
run it slower (a 256-token chunk's faster: benchmarks/weight_layouts.py, results/2026-11-26-emerald-rapids.md); a
rounded integer one shifts every weight of a block by up to half a step. So, per group g of the
input dimension,

    x . w_row = sum_g scale_g * (x_g . q_g) + sum_g offset_g * sum(x_g)

the first term the plugin's fast kernel on the integers alone, the second a small product of the
input's per-group sums ([.., K/32]) with the offsets ([rows, K/32], a sixteenth of the weight's
elements): exact, as llama.cpp computes these types. A token table gathered from such blocks gets
its rows' offsets gathered and broadcast over their groups.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import openvino as ov
import openvino.opset13 as ops


_INTEGERS = (ov.Type.u4, ov.Type.i4, ov.Type.u8, ov.Type.i8)


def _const(value) -> ov.Output:
    return ops.constant(np.asarray(value, dtype=np.int64)).output(0)


def split_block_offsets(model: ov.Model) -> int:
    """In place. Returns how many weight uses were rewritten."""
    by_input: dict[ov.Output, list[tuple[ov.Node, ov.Output, ov.Node]]] = defaultdict(list)
    count = 0
    for node in model.get_ordered_ops():
        kind = node.get_type_name()
        if kind == "MatMul" and node.get_attributes() == {"transpose_a": False, "transpose_b": True}:
            parts = _offset_chain(node.input_value(1))
            if parts:
                by_input[node.input_value(0)].append((node, *parts))
        elif kind == "Gather" and is_axis0(node):
            parts = _offset_chain(node.input_value(0))
            if parts:
                _split_gather(node, *parts)
                count += 1
    for x, uses in by_input.items():
        _split_matmuls(x, uses)
        count += len(uses)
    if count:
        model.validate_nodes_and_infer_types()
    return count


def is_axis0(gather: ov.Node) -> bool:
    """Whether a Gather takes rows (axis 0, a constant): a token table's."""
    axis = gather.input_value(2).get_node()
    return axis.get_type_name() == "Constant" and int(np.asarray(axis.get_data()).reshape(-1)[0]) == 0


def _offset_chain(weight: ov.Output) -> tuple[ov.Output, ov.Node] | None:
    """Convert(f32) <- Reshape([rows, K]) <- Add(Multiply(..), offset [rows, G, 1]): the weight
    without its offset (same shape and type) and the offset constant."""
    convert = weight.get_node()
    if convert.get_type_name() != "Convert":
        return None
    reshape = convert.input_value(0).get_node()
    if reshape.get_type_name() != "Reshape":
        return None
    add = reshape.input_value(0).get_node()
    if add.get_type_name() != "Add" or add.input_value(1).get_node().get_type_name() != "Constant":
        return None
    scaled = add.input_value(0)
    if not _is_decompression(scaled.get_node()):
        return None
    offset = add.input_value(1).get_node()
    shape = tuple(offset.get_output_shape(0))
    if len(shape) != 3 or shape[2] != 1:
        return None
    plain = ops.convert(ops.reshape(scaled, reshape.input_value(1), special_zero=False),
                        convert.get_output_element_type(0))
    return plain.output(0), offset


def _is_decompression(multiply: ov.Node) -> bool:
    """Multiply(Convert(integer Constant), Constant): integers times their scales."""
    if multiply.get_type_name() != "Multiply" or multiply.input_value(1).get_node().get_type_name() != "Constant":
        return False
    convert = multiply.input_value(0).get_node()
    if convert.get_type_name() != "Convert":
        return False
    q = convert.input_value(0).get_node()
    return q.get_type_name() == "Constant" and q.get_element_type() in _INTEGERS


def _offsets_f32(offsets: list[ov.Node]) -> ov.Output:
    """Offset constants [rows_i, G, 1] -> one f32 matrix [sum rows_i, G]."""
    data = np.concatenate([np.asarray(o.get_data()) for o in offsets]) if len(offsets) > 1 else offsets[0].get_data()
    rows, groups = data.shape[:2]
    return ops.convert(ops.constant(np.asarray(data).reshape(rows, groups)), ov.Type.f32).output(0)


def _group_sums(x: ov.Output, groups: int) -> ov.Output:
    """x [..., K] -> [..., groups], the sum of each group of K / groups inputs."""
    lead = ops.slice(ops.shape_of(x), _const([0]), _const([-1]), _const([1]))
    grouped = ops.reshape(x, ops.concat([lead, _const([groups, -1])], axis=0), special_zero=False)
    return ops.reduce_sum(grouped, _const([-1]), keep_dims=False).output(0)


def _split_matmuls(x: ov.Output, uses: list[tuple[ov.Node, ov.Output, ov.Node]]) -> None:
    """Every weight reading x (q, k and v read one) gets its integer product; their corrections
    are one product of x's group sums with all their offsets, split after (fewer small ops: at
    one sequence each op's fixed cost, not its arithmetic, is what a correction costs)."""
    groups = uses[0][2].get_output_shape(0)[1]
    assert all(o.get_output_shape(0)[1] == groups for _, _, o in uses), "one input, one grouping"
    corrections = ops.matmul(_group_sums(x, groups), _offsets_f32([o for _, _, o in uses]),
                             transpose_a=False, transpose_b=True).output(0)
    if len(uses) > 1:
        rows = np.array([o.get_output_shape(0)[0] for _, _, o in uses], dtype=np.int64)
        split = ops.variadic_split(corrections, _const(-1), ops.constant(rows))
        parts = [split.output(i) for i in range(len(uses))]
    else:
        parts = [corrections]
    for (matmul, plain, _), correction in zip(uses, parts):
        main = ops.matmul(x, plain, transpose_a=False, transpose_b=True)
        main.set_friendly_name(matmul.get_friendly_name())
        matmul.output(0).replace(ops.add(main, correction).output(0))


def _split_gather(gather: ov.Node, plain: ov.Output, offset: ov.Node) -> None:
    ids, axis = gather.input_value(1), gather.input_value(2)
    rows = ops.gather(plain, ids, axis)
    picked = ops.gather(_offsets_f32([offset]), ids, axis)  # [..., G]
    group = plain.get_partial_shape()[1].get_length() // offset.get_output_shape(0)[1]
    spread = ops.multiply(ops.unsqueeze(picked, _const([-1])), ops.constant(np.ones(group, dtype=np.float32)))
    lead = ops.slice(ops.shape_of(picked), _const([0]), _const([-1]), _const([1]))
    full = ops.reshape(spread, ops.concat([lead, _const([-1])], axis=0), special_zero=False)
    gather.output(0).replace(ops.add(rows, full).output(0))
