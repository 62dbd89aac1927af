"""Load-time graph pass: projections that read the same activation become one MatMul.

q/k/v of a layer (and gate/up of its MLP) each read the normed hidden state with their own weight.
At decode one token multiplies each weight once, so every projection is a memory-bound FullyConnected
with a fixed cost of its own; the small ones waste most of it (SmolLM2 on Zen 4: a 192x576 k or v
projection streams its weights at 11 GB/s, a 1536x576 one at 23 GB/s). Concatenating the weights
row-wise and splitting the output gives the same numbers (each output column is the same dot
product) from fewer, larger kernels: fusing q/k/v took 3-4% off a one-sequence decode step there
and 1.6% at 64 sequences, prefill unchanged within the noise.

Projections feeding an activation (the MLP's gate, into Swish) stay apart: the plugin fuses the
activation into that FullyConnected, and merging gate with up loses it (a separate Swish over the
split); measured, gate/up fusion made 64-sequence decode 1-3% and prefill 2-8% slower.

The pass works on the weights' decompression chains as exported (f16 Convert, u8 with per-row zero
point and scale, 4- and 8-bit groups reshaped to [rows, K]), merging their constants row-wise;
anything it does not recognise is left alone. OpenVINO's CPU plugin has fusions of its own for AMX
CPUs with bf16 compute (QKVProjFusion / MLPFusion), so the pass was off there; measured on a
Sapphire Rapids (openvino 2026.4.1), they left these graphs' q/k/v as three FullyConnected nodes
(f16, u4 and i4 weights alike), and fusing them took 3.5-4.5% off a one-sequence decode step's CPU
time (SmolLM2 f16 and auto, a 1.5B-shaped Q4_0 model): it runs on every CPU.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import openvino as ov
import openvino.opset13 as ops

# Constants merged row-wise: numpy holds these element for element; 4-bit ones as packed bytes,
# whole bytes per row (bf16 is not merged).
_MERGEABLE = {ov.Type.f32, ov.Type.f16, ov.Type.u8, ov.Type.i8}
_PACKED = {ov.Type.u4, ov.Type.i4}
_CHAIN_OPS = {"Convert", "Subtract", "Multiply", "Add", "Reshape"}
_ACTIVATIONS = {"Swish", "Gelu", "Relu", "Sigmoid", "Tanh", "HSwish", "Mish", "Elu", "Clamp"}


def fuse_projections(model: ov.Model, activation_inputs: bool = False) -> int:
    """In place. Returns how many groups of MatMuls were merged; with `activation_inputs` also
    those feeding an activation (gate with up: the decode model's own kernel fuses no activation,
    so one product saves a call, see model/lowbit)."""
    groups: dict[ov.Output, list[ov.Node]] = defaultdict(list)
    for node in model.get_ordered_ops():
        if node.get_type_name() == "MatMul" and node.get_attributes() == {"transpose_a": False, "transpose_b": True}:
            weight = node.input_value(1)
            if _rows(weight) is not None:
                groups[node.input_value(0)].append(node)
    fused = 0
    for source, matmuls in groups.items():
        if len(matmuls) > 1 and (activation_inputs or not any(feeds_activation(m.output(0)) for m in matmuls)) and _fuse(source, matmuls):
            fused += 1
    if fused:
        model.validate_nodes_and_infer_types()
    return fused


def feeds_activation(output: ov.Output) -> bool:
    """Whether `output` is an activation's input: directly, or through the Add of a block-offset
    correction (block_offsets.py)."""
    for t in output.get_target_inputs():
        consumer = t.get_node()
        if consumer.get_type_name() in _ACTIVATIONS:
            return True
        if consumer.get_type_name() == "Add" and feeds_activation(consumer.output(0)):
            return True
    return False


def _rows(weight: ov.Output) -> int | None:
    """Output rows of a static [rows, K] weight, or None when its shape is not known."""
    shape = _rows_and_cols(weight)
    return shape[0] if shape else None


def _fuse(source: ov.Output, matmuls: list[ov.Node]) -> bool:
    weight = _merge([m.input_value(1) for m in matmuls])
    if weight is None:
        return False
    rows = [_rows(m.input_value(1)) for m in matmuls]
    fused = ops.matmul(source, weight, transpose_a=False, transpose_b=True,
                       name="/".join(m.get_friendly_name() for m in matmuls))
    parts = ops.variadic_split(fused, ops.constant(np.int64(-1)), ops.constant(np.array(rows, dtype=np.int64)))
    for i, m in enumerate(matmuls):
        m.output(0).replace(parts.output(i))
    return True


def _merge(outputs: list[ov.Output]) -> ov.Output | None:
    """One chain computing the row-wise concatenation of structurally identical weight chains."""
    nodes = [o.get_node() for o in outputs]
    kind = nodes[0].get_type_name()
    if any(n.get_type_name() != kind for n in nodes) or any(o.get_index() != 0 for o in outputs):
        return None
    if kind == "Constant":
        return _merge_constants(nodes)
    if kind not in _CHAIN_OPS or any(n.get_attributes() != nodes[0].get_attributes() for n in nodes):
        return None
    if kind == "Reshape":
        shapes = [_rows_and_cols(o) for o in outputs]
        if None in shapes or len({cols for _, cols in shapes}) != 1:
            return None
    inputs = []
    for i in range(1 if kind == "Reshape" else nodes[0].get_input_size()):
        merged = _merge([n.input_value(i) for n in nodes])
        if merged is None:
            return None
        inputs.append(merged)
    if kind == "Convert":
        return ops.convert(inputs[0], nodes[0].get_output_element_type(0)).output(0)
    if kind == "Reshape":  # [rows, K] targets: the merged rows, the same K
        target = np.array([sum(rows for rows, _ in shapes), shapes[0][1]], dtype=np.int64)
        return ops.reshape(inputs[0], ops.constant(target), special_zero=False).output(0)
    return {"Subtract": ops.subtract, "Add": ops.add, "Multiply": ops.multiply}[kind](*inputs).output(0)


def _rows_and_cols(o: ov.Output) -> tuple[int, int] | None:
    shape = o.get_partial_shape()
    return (shape[0].get_length(), shape[1].get_length()) if shape.is_static and len(shape) == 2 else None


def _merge_constants(nodes: list[ov.Node]) -> ov.Output | None:
    kind = nodes[0].get_element_type()
    if any(n.get_element_type() != kind for n in nodes):
        return None
    if kind in _PACKED:
        return _merge_packed(nodes)
    if kind not in _MERGEABLE:
        return None
    data = [n.get_data() for n in nodes]
    if any(d.ndim != data[0].ndim or d.shape[1:] != data[0].shape[1:] for d in data):
        return None
    if data[0].ndim == 0 or all(d.shape[0] == 1 for d in data):
        # broadcast over rows (a scalar scale, say): the chains agree only if it is the same value
        return nodes[0].output(0) if all(np.array_equal(d, data[0]) for d in data) else None
    return ops.constant(np.concatenate(data, axis=0)).output(0)


def _merge_packed(nodes: list[ov.Node]) -> ov.Output | None:
    """4-bit constants [rows, ...]: their packed bytes, row after row."""
    shapes = [tuple(n.get_output_shape(0)) for n in nodes]
    if any(len(sh) < 2 or sh[1:] != shapes[0][1:] for sh in shapes) or int(np.prod(shapes[0][1:])) % 2:
        return None
    data = np.concatenate([np.asarray(n.get_data()).reshape(sh[0], -1) for n, sh in zip(nodes, shapes)])
    merged = ov.Tensor(nodes[0].get_element_type(), ov.Shape([data.shape[0], *shapes[0][1:]]))
    np.copyto(merged.data.reshape(data.shape), data)
    return ops.constant(merged).output(0)
