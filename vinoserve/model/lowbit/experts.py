"""Load-time graph pass: a mixture of experts' products (model/moe.py's GroupedMatMul over a
stacked decompression chain, [E, N, K]) on the kernel's LowBitExperts (lowbit_experts.hpp), which
reads each routed expert's tiles once for all of its rows; the block minimums' product moe.py
adds beside it (sums of x times offsets) goes into the kernel's, as for plain matrices."""
from __future__ import annotations

import openvino as ov
import openvino.opset13 as ops
from openvino.utils.node_factory import NodeFactory

from vinoserve.model import moe
from vinoserve.model.lowbit import pack
from vinoserve.model.lowbit.rewrite import decompression, packed

OP = "LowBitExperts"


def replace_experts(model: ov.Model, factory: NodeFactory, planes: ov.Output | None = None,
                    prefetch: int = 1024) -> int:
    """In place. Returns how many expert products now run on the kernel, x quantized in one int8
    plane or (`planes` given) as many as that scalar says."""
    count = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "GroupedMatMul" or node.get_output_element_type(0) != ov.Type.f32:
            continue
        found = decompression(node.input_value(1), rank=4)
        if found is None or found[2] is not None:
            continue
        q, scale, _ = found
        experts, n = (int(d) for d in q.get_output_shape(0)[:2])
        if n % pack.TILE or node.get_input_partial_shape(0).rank.get_length() != 2:
            continue
        add, offset = _offset_product(node)
        arrays, layout = packed(q, scale, offset)
        inputs = [node.input_value(0), node.input_value(2), *(ops.constant(a).output(0) for a in arrays)]
        if planes is not None:
            inputs.append(planes)
        lowbit = factory.create(OP, inputs, {"experts": experts, "n": n, "planes": 0 if planes is not None else 1,
                                             "prefetch": prefetch, **layout})
        lowbit.set_friendly_name(node.get_friendly_name())
        (add or node).output(0).replace(lowbit.output(0))
        count += 1
    if count:
        model.validate_nodes_and_infer_types()
    return count


def count(model: ov.Model) -> int:
    """How many expert products of the graph run on the kernel."""
    return sum(node.get_type_name() == OP for node in model.get_ordered_ops())


def _offset_product(node: ov.Node) -> tuple[ov.Node | None, ov.Node | None]:
    """moe._product's Add of the offsets' product after the GroupedMatMul, and the offsets as the
    chain's shape [E, N, G, 1] wants them, where there is one."""
    targets = [t.get_node() for t in node.output(0).get_target_inputs()]
    if len(targets) != 1 or targets[0].get_type_name() != "Add":
        return None, None
    add = targets[0]
    other = next(v.get_node() for v in add.input_values() if v.get_node().get_instance_id() != node.get_instance_id())
    if not moe.is_minimums_product(other) or other.input_value(2) != node.input_value(2):
        return None, None
    offsets = other.input_value(1).get_node()
    if offsets.get_type_name() != "Constant" or offsets.get_element_type() != ov.Type.f32:
        return None, None
    return add, ops.constant(offsets.get_data().reshape(*offsets.get_output_shape(0), 1))
