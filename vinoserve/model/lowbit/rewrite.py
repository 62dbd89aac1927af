"""Load-time graph pass for the decode model: each MatMul whose weight is a low-bit decompression
chain (Convert(integers) -> Multiply(scale) [-> Add(offset)] -> Reshape -> Convert, as weights.py
writes it) becomes a LowBitMatMul reading the same integers, scales and offsets, repacked into
the kernel's tiles; it runs before block_offsets, whose correction products the kernel makes
unnecessary. A token table's Gather from such a chain becomes a LowBitGather reading the same
integers and scales (copied as bytes). Anything else (f16 weights, int8 with zero points) stays
the plugin's."""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.utils.node_factory import NodeFactory

from vinoserve.memory import release_freed_heap
from vinoserve.model.block_offsets import is_axis0
from vinoserve.model.fuse_projections import feeds_activation
from vinoserve.model.lowbit import pack

OP = "LowBitMatMul"
GATHER_OP = "LowBitGather"
_SIGNED = {ov.Type.i4: True, ov.Type.u4: False, ov.Type.i8: True, ov.Type.u8: False}
_GROUPS = (16, 32)  # what the kernel has code for
K_BLOCK = 256  # weights a K-quant's f16 factor covers
_CENTRES = (8, 16)  # weights.py's centring of Q4_K's and Q5_K's values (quantized._centred)


# In a step of two planes, the products that take them on the sampled rows only (the rows whose
# logits are read), one on the rest of a prompt's (cpu_defaults.py chooses per CPU class): the
# MLP's gate and up, or every product but the attention's q/k/v, whose outputs fill the cache.
COARSE = ("gate_up", "all_but_qkv")


def replace_matmuls(model: ov.Model, factory: NodeFactory, planes: ov.Output | None = None,
                    prefetch: int = 1024, sampled: ov.Output | None = None, coarse: str = "gate_up") -> int:
    """In place. Returns how many MatMuls now run on the kernel. Each quantizes x in one int8
    plane, or (`planes` given) in as many as that scalar says, a step at a time; then the logits'
    MatMul always takes two: its errors are the logits' (lowbit_matmul.cpp). With `sampled` (the
    rows whose logits a step reads) as well, the `coarse` products (COARSE) take two planes on
    those rows only, one on the rest of a prompt's."""
    assert coarse in COARSE, coarse
    count = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul" or node.get_attributes() != {"transpose_a": False, "transpose_b": True}:
            continue
        found = decompression(node.input_value(1))
        if found is None or node.get_output_element_type(0) != ov.Type.f32:
            continue
        split = _column_split(node)
        outputs = node.outputs() if split is None else split[0].outputs()
        logits = _gives_logits(node)
        rough = any(map(feeds_activation, outputs)) if coarse == "gate_up" else not (logits or _fills_cache(outputs))
        lowbit = _lowbit_node(factory, node.input_value(0), *found,
                              None if planes is None else 2 if logits else planes,
                              [] if split is None else split[1], prefetch,
                              sampled if rough and isinstance(planes, ov.Output) else None)
        lowbit.set_friendly_name(node.get_friendly_name())
        for i, output in enumerate([node.output(0)] if split is None else split[0].outputs()):
            output.replace(lowbit.output(i))
        count += 1
    if count:
        model.validate_nodes_and_infer_types()
        release_freed_heap()  # the repacking's temporaries, before compiling fills the heap around them
    return count


def replace_gathers(model: ov.Model, factory: NodeFactory) -> int:
    """In place: each Gather of rows (axis 0) from a decompression chain reads them with the
    kernel library's LowBitGather, which the plugin would run on its reference code (a 1.5B Q4_0
    decode step's 0.47 of 19.6 ms for one row; Zen 5). Returns how many."""
    count = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Gather" or node.get_attributes().get("batch_dims", 0) != 0 or not is_axis0(node):
            continue
        found = decompression(node.input_value(0))
        ids = node.input_value(1)
        if found is None or ids.get_element_type() not in (ov.Type.i32, ov.Type.i64):
            continue
        gather = factory.create(GATHER_OP, [ids, *_gather_inputs(*found)], _gather_attributes(found[0]))
        gather.set_friendly_name(node.get_friendly_name())
        node.output(0).replace(gather.output(0))
        count += 1
    if count:
        model.validate_nodes_and_infer_types()
    return count


def _gather_inputs(q: ov.Node, scale: ov.Node, offset: ov.Node | None) -> list[ov.Output]:
    """The table's integers as bytes, and its scales and offsets in one type: f32, or f16s as
    bytes. The plugin would give a Reference node a 4-bit constant widened to int8 (twice the
    table's bytes), an f16 one as f32."""
    rows = q.get_output_shape(0)[0]
    floats = [c for c in (scale, offset) if c is not None]
    f32 = any(c.get_element_type() == ov.Type.f32 for c in floats)

    def as_bytes(c: ov.Node) -> ov.Output:
        return ops.constant(np.asarray(c.get_data()).view(np.uint8).reshape(rows, -1)).output(0)

    def as_f32(c: ov.Node) -> ov.Output:
        if c.get_element_type() == ov.Type.f32:
            return c.output(0)
        return ops.constant(np.asarray(c.get_data(), np.float32)).output(0)

    return [as_bytes(q), *(as_f32(c) if f32 else as_bytes(c) for c in floats)]


def _gather_attributes(q: ov.Node) -> dict:
    rows, groups, group = (int(d) for d in q.get_output_shape(0))
    return {"k": groups * group, "bits": q.get_element_type().bitwidth, "group": group,
            "is_signed": _SIGNED[q.get_element_type()]}


def _narrow_bits(u: np.ndarray, group: int) -> int:
    """The fewest bits, 5 or 6, in which int8 values (u = q + 128) all lie in [-2^(b-1), 2^(b-1)),
    losslessly (5 with groups of 32 only: Q5_K's, Q5_0's, Q5_1's; 6: Q6_K's); 8 where neither
    fits. Any int8 matrix may (a Q8_0's or the int8 conversion's take the whole range, so they do not)."""
    low, high = 255, 0
    for r in range(0, len(u), 4096):  # slices: one pass, no full-size temporaries
        low, high = min(low, int(u[r:r + 4096].min())), max(high, int(u[r:r + 4096].max()))
        if low < 96 or high >= 160:  # not even 6 bits (a Q8_0's, the int8 conversion's)
            return 8
    for bits in (5, 6) if group == 32 else (6,):
        if low >= 128 - (1 << (bits - 1)) and high < 128 + (1 << (bits - 1)):
            return bits
    return 8


def _column_split(node: ov.Node) -> tuple[ov.Node, list[int]] | None:
    """The VariadicSplit of the MatMul's columns that fuse_projections put after it, and its parts,
    where each is whole tiles: the kernel stores each part as an output of its own instead, a
    copy less (a 1.5B Q4_0 prompt step 0.984x the time, decode unchanged; Zen 5)."""
    targets = list(node.output(0).get_target_inputs())
    split = targets[0].get_node() if len(targets) == 1 else None
    if split is None or split.get_type_name() != "VariadicSplit":
        return None
    axis, lengths = (split.input_value(i).get_node() for i in (1, 2))
    if axis.get_type_name() != "Constant" or lengths.get_type_name() != "Constant":
        return None
    rank = node.get_output_partial_shape(0).rank.get_length()
    parts = [int(n) for n in lengths.get_data()]
    if int(axis.get_data()) % rank != rank - 1 or len(parts) > 4 or any(n <= 0 or n % pack.TILE for n in parts):
        return None
    return split, parts


def _fills_cache(outputs: list[ov.Output], hops: int = 16) -> bool:
    """Whether the outputs reach a PagedAttention within `hops` nodes without another MatMul on the
    way: the attention's q/k/v (through their reshapes, norms and RoPE), not the o projection or
    the MLP, whose outputs reach the next layer's attention only through its q/k/v."""
    seen: set[str] = set()  # by name: a node's Python wrapper is new at each look, so ids repeat
    todo = [(t.get_node(), 1) for output in outputs for t in output.get_target_inputs()]
    while todo:
        node, depth = todo.pop()
        if node.get_type_name() == "PagedAttentionExtension":
            return True
        if depth >= hops or node.get_name() in seen or node.get_type_name() in ("MatMul", OP):
            continue
        seen.add(node.get_name())
        todo += [(t.get_node(), depth + 1) for out in node.outputs() for t in out.get_target_inputs()]
    return False


def _gives_logits(node: ov.Node) -> bool:
    """Whether the MatMul's output reaches a Result through elementwise steps only (a final
    softcapping's Divide, Tanh, Multiply)."""
    for _ in range(5):
        targets = [t.get_node() for t in node.output(0).get_target_inputs()]
        if any(t.get_type_name() == "Result" for t in targets):
            return True
        if len(targets) != 1 or targets[0].get_type_name() not in {"Convert", "Divide", "Tanh", "Multiply"}:
            return False
        node = targets[0]
    return False


def decompression(weight: ov.Output, rank: int = 3) -> tuple[ov.Node, ov.Node, ov.Node | None] | None:
    """Convert(f32) <- Reshape [rows, K] <- [Add(.., offset [rows, G, 1]) <-] Multiply(Convert(q
    [rows, G, g]), scale [rows, G, 1]): the q, scale and offset constants, where the kernel takes
    their types and group. `rank` 4: a stack of such matrices, q [E, rows, G, g] (experts')."""
    convert = weight.get_node()
    if convert.get_type_name() != "Convert" or convert.input_value(0).get_node().get_type_name() != "Reshape":
        return None
    multiply, offset = convert.input_value(0).get_node().input_value(0).get_node(), None
    if multiply.get_type_name() == "Add":
        offset = multiply.input_value(1).get_node()
        multiply = multiply.input_value(0).get_node()
    if multiply.get_type_name() != "Multiply":
        return None
    convert = multiply.input_value(0).get_node()
    scale = multiply.input_value(1).get_node()
    if convert.get_type_name() != "Convert" or scale.get_type_name() != "Constant":
        return None
    q = convert.input_value(0).get_node()
    if q.get_type_name() != "Constant" or q.get_element_type() not in _SIGNED:
        return None
    shape, s_shape = tuple(q.get_output_shape(0)), tuple(scale.get_output_shape(0))
    if len(shape) != rank or shape[-1] not in _GROUPS or s_shape != (*shape[:-1], 1):
        return None
    if any(c is not None and (c.get_type_name() != "Constant" or c.get_element_type() not in (ov.Type.f16, ov.Type.f32)
                              or tuple(c.get_output_shape(0)) != s_shape) for c in (scale, offset)):
        return None
    return q, scale, offset


def _floats(c: ov.Node, rows: int, groups: int) -> np.ndarray:
    return np.asarray(c.get_data()).reshape(rows, groups)


def _float_inputs(scale: ov.Node, offset: ov.Node | None, rows: int, groups: int,
                  group: int) -> tuple[list[np.ndarray], dict[str, int]]:
    """The kernel's scale and offset inputs, and its `block` and `centre`: f32 scales (the
    K-quants') as the file's factors where they give them back exactly, else the floats, one type
    for both: f32, or f16 as bytes (the plugin would widen an f16 constant to f32)."""
    block = K_BLOCK // group
    if scale.get_element_type() == ov.Type.f32 and groups % block == 0:
        factored = _factored(scale, offset, rows, groups, block)
        if factored is not None:
            return factored
    f32 = any(c is not None and c.get_element_type() == ov.Type.f32 for c in (scale, offset))
    packed = [pack.pack_floats(_floats(c, rows, groups).astype(np.float32 if f32 else np.float16))
              for c in (scale, offset) if c is not None]
    return [p if f32 else p.view(np.uint8) for p in packed], {"block": 0, "centre": 0, "factor_bits": 8}


def _factored(scale: ov.Node, offset: ov.Node | None, rows: int, groups: int,
              block: int) -> tuple[list[np.ndarray], dict[str, int]] | None:
    s = _floats(scale, rows, groups)
    s_factors = pack.factor(s, block)
    if s_factors is None:
        return None
    if offset is None:
        bits = pack.factor_bits(s_factors[1])
        return [pack.pack_factored(*s_factors, bits)], {"block": block, "centre": 0, "factor_bits": bits}
    o = _floats(offset, rows, groups).astype(np.float32)
    for centre in _CENTRES:
        m = pack.minimum(o, s, centre)
        m_factors = None if m is None else pack.factor(m, block)
        if m_factors is not None:
            bits = pack.factor_bits(s_factors[1], m_factors[1])  # one layout for both
            return ([pack.pack_factored(*s_factors, bits), pack.pack_factored(*m_factors, bits)],
                    {"block": block, "centre": centre, "factor_bits": bits})
    return None


def packed(q: ov.Node, scale: ov.Node, offset: ov.Node | None) -> tuple[list[np.ndarray], dict[str, int]]:
    """The kernel's weight, scale [and offset] inputs for a decompression chain's constants (q
    [.., rows, G, g]: every leading dimension's matrices stacked, a tile never spanning two where
    their rows are whole tiles), and the attributes saying their layout."""
    *lead, groups, group = (int(d) for d in q.get_output_shape(0))
    rows, k = int(np.prod(lead)), groups * group
    bits = q.get_element_type().bitwidth
    signed = _SIGNED[q.get_element_type()]
    bias = (1 << (bits - 1)) if signed else 0
    u = pack.unsigned(q.get_data(), rows, k, bits, signed)
    e2m1 = False
    if bits == 8 and signed and group == 32 and (codes := pack.e2m1_codes(u)) is not None:  # MXFP4's, doubled
        u, bits, bias, e2m1 = codes, 4, pack.E2M1_BIAS, True
    elif bits == 8 and signed and (narrow := _narrow_bits(u, group)) < 8:  # 5- and 6-bit values widened to int8
        bits, bias = narrow, 1 << (narrow - 1)
        u -= 128 - bias
    floats, layout = _float_inputs(scale, offset, rows, groups, group)
    return [pack.pack_weights(u, bits, group), *floats], {"k": k, "bits": bits, "group": group, "bias": bias,
                                                          "e2m1": int(e2m1), **layout}


def _lowbit_node(factory: NodeFactory, x: ov.Output, q: ov.Node, scale: ov.Node, offset: ov.Node | None,
                 planes: ov.Output | int | None, parts: list[int], prefetch: int,
                 sampled: ov.Output | None = None) -> ov.Node:
    """`planes`: a fixed count, or the scalar input that gives it (None: one); `parts`: the
    outputs' widths (empty: one output); `prefetch`: the CPU class's distance (cpu_defaults.py);
    `sampled` (with a planes input): the rows that take two planes when it says two."""
    arrays, layout = packed(q, scale, offset)
    inputs = [x, *(ops.constant(a).output(0) for a in arrays)]
    if sampled is not None:
        inputs.append(sampled)
    if isinstance(planes, ov.Output):
        inputs.append(planes)
    count = 0 if isinstance(planes, ov.Output) else planes or 1
    return factory.create(OP, inputs, {"n": int(q.get_output_shape(0)[0]), "planes": count, "prefetch": prefetch,
                                       "parts": parts, "sampled": int(sampled is not None), **layout})
