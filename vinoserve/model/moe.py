"""A mixture-of-experts FFN (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss): a router picks `used` of
`count` experts for each token, each picked expert runs its gated FFN on the token, and the
token's output is their sum weighted by the router (llama.cpp's build_moe_ffn).

The experts' products are OpenVINO's GroupedMatMul (opset 17): the (token, expert) pairs sorted
by expert, each expert's run of rows multiplied by its own [N, K] slice of one [E, N, K] weight.
Where vinoserve's low-bit kernel runs (every x86-64 class's default compilation of a mixture of
experts: cpu_defaults.py), a load-time pass puts each on its LowBitExperts (lowbit/experts.py):
an expert's rows share each read of its tiles, experts no row was routed to are not read, and
block minimums go inside the product. Elsewhere the CPU plugin rewrites it into its GatherMatmul
op (ConvertGroupedMatMulToGatherMatmul), which reads only the routed experts and keeps 4- and 8-bit
experts compressed (GatherMatmulCompressed) behind weights.py's decompression chain, but
multiplies each (token, expert) pair on its own: at f32 6x below a dense product of the same
FLOPs, at bf16 a fixed ~40 ms a call for 64 experts (one thread, OLMoE-1B-7B's sizes, i4); the
kernel's figures: benchmarks/results/2026-12-03-moe-kernel.md. optimum-intel's exports hold the
tiled form instead (the tokens tiled over every expert, batched MatMuls against [E, N, K], a [T, E]
routing map), which the plugin fuses into the same GatherMatmul where it recognises the block
(ConvertTiledMoeBlockToGatherMatmuls): `is_expert_product` counts both forms, and the startup log
says whether the plugin gathered them (paged.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import openvino.opset17 as opset17

from vinoserve.model.blocks import const, glu
from vinoserve.model.config import ExpertRouting, Gating


@dataclass(frozen=True)
class ExpertMatrices:
    """One projection of every expert: `values` f32 [E, N, K]; `offsets` f32 [E, N, K / group]
    where the file's type stores a minimum per block, kept out of `values` because the plugin's
    compressed weights take no such term (block_offsets.py says why, for plain matrices);
    `bias` f32 [E, N], each expert's own (gpt-oss)."""

    values: ov.Output
    offsets: ov.Output | None = None
    bias: np.ndarray | None = None


def route(x: ov.Output, router: np.ndarray, routing: ExpertRouting,
          bias: np.ndarray | None = None) -> tuple[ov.Output, ov.Output]:
    """x [T, H], router [E, H] (and its bias [E]) -> each token's experts i32 [T, used] and their
    weights f32 [T, used], highest first. The router stays f32: a rounded logit can swap two experts."""
    logits = ops.matmul(x, const(router, np.float32), transpose_a=False, transpose_b=True)
    if bias is not None:
        logits = ops.add(logits, const(bias, np.float32))
    k = const(routing.used, np.int32)
    if routing.gating == Gating.SOFTMAX_SELECTED:
        top = ops.topk(logits, k, -1, "max", "value", "i32")
        weights = ops.softmax(top.output(0), -1).output(0)
    else:
        probs = ops.softmax(logits, -1) if routing.gating == Gating.SOFTMAX else ops.sigmoid(logits)
        top = ops.topk(probs, k, -1, "max", "value", "i32")
        weights = top.output(0)
    if routing.normalize:
        weights = ops.divide(weights, ops.reduce_sum(weights, const([-1]), keep_dims=True)).output(0)
    if routing.scale != 1.0:
        weights = ops.multiply(weights, const(routing.scale, np.float32)).output(0)
    return top.output(1), weights


def expert_ffn(x: ov.Output, router: np.ndarray, routing: ExpertRouting, gate: ExpertMatrices,
               up: ExpertMatrices, down: ExpertMatrices, activation: str,
               router_bias: np.ndarray | None = None) -> ov.Output:
    """x [B, L, H] -> sum over each token's experts of weight * down(act(gate(x)) * up(x))
    (`activation` as blocks.glu names it)."""
    hidden = x.get_partial_shape()[-1].get_length()
    flat = ops.reshape(x, const([-1, hidden]), special_zero=False)
    experts, weights = route(flat, router, routing, router_bias)
    order, ends = _by_expert(experts, routing.count)
    rows = ops.gather(flat, ops.divide(order, const(routing.used, np.int32)), const(0))  # pair -> its token
    row_experts = ops.gather(ops.reshape(experts, const([-1]), special_zero=False), order, const(0)).output(0)

    def product(a: ov.Output, m: ExpertMatrices) -> ov.Output:
        y = _product(a, m, ends)
        if m.bias is None:
            return y
        return ops.add(y, ops.gather(const(m.bias, np.float32), row_experts, const(0))).output(0)

    out = product(glu(activation, product(rows, gate), product(rows, up)), down)
    # row i of `out` is pair order[i]: back to (token, choice) order, then the weighted sum
    pairs = ops.scatter_update(ops.broadcast(const(0.0, np.float32), ops.shape_of(out)), order, out, const(0))
    per_token = ops.reshape(pairs, const([-1, routing.used, hidden]), special_zero=False)
    mixed = ops.reduce_sum(ops.multiply(per_token, ops.unsqueeze(weights, const(-1))), const([1]), keep_dims=False)
    return ops.reshape(mixed, ops.shape_of(x), special_zero=False).output(0)


def _by_expert(experts: ov.Output, count: int) -> tuple[ov.Output, ov.Output]:
    """Each token's experts [T, used] -> the (token, choice) pairs sorted by expert, as flat
    indices token * used + choice (i32 [T * used]), and where each expert's run of them ends
    (GroupedMatMul's offsets, i32 [count]). Within an expert pairs keep their order: the sort key
    expert * pairs + index is unique, so the order does not depend on TopK's tie-breaking."""
    flat = ops.reshape(experts, const([-1]), special_zero=False)
    pairs = ops.squeeze(ops.shape_of(flat, "i32"), const(0))
    index = ops.range(const(0, np.int32), pairs, const(1, np.int32), "i32")
    key = ops.add(ops.multiply(flat, pairs), index)
    order = ops.topk(key, pairs, 0, "min", "value", "i32").output(1)
    per_expert = ops.reduce_sum(ops.one_hot(flat, const(count, np.int32), const(1, np.int32), const(0, np.int32), -1),
                                const([0]), keep_dims=False)
    return order, ops.cumsum(per_expert, const(0, np.int32)).output(0)


def is_expert_product(node: ov.Node) -> bool:
    """A GroupedMatMul of an expert's rows (not its block minimums'), or a MatMul against a stack
    of expert matrices built from constants (optimum-intel's tiled form)."""
    if node.get_type_name() == "GroupedMatMul":
        return not is_minimums_product(node)
    weights = node.get_input_partial_shape(1) if node.get_type_name() == "MatMul" else None
    return weights is not None and weights.rank.is_static and weights.rank.get_length() == 3 \
        and _from_constants(node.input_value(1))


def _from_constants(output: ov.Output, depth: int = 6) -> bool:
    """Whether only constants feed `output` (weights and their decompression: Convert, Subtract,
    Multiply, Reshape), within `depth` ops."""
    node = output.get_node()
    if node.get_type_name() == "Constant":
        return True
    return depth > 0 and node.get_type_name() in ("Convert", "Subtract", "Multiply", "Reshape") \
        and all(_from_constants(i, depth - 1) for i in node.input_values())


def is_minimums_product(node: ov.Node) -> bool:
    """Whether a GroupedMatMul is `_product`'s second one (group sums times block minimums), not
    an expert product of its own."""
    return node.get_type_name() == "GroupedMatMul" and node.input_value(0).get_node().get_type_name() == "ReduceSum"


def _product(rows: ov.Output, m: ExpertMatrices, ends: ov.Output) -> ov.Output:
    """Each row times its expert's matrix; with offsets, plus the per-group sums of the row times
    them: x . w = sum_g scale_g (x_g . q_g) + sum_g offset_g sum(x_g), exactly."""
    y = opset17.grouped_matmul(rows, m.values, ends)
    if m.offsets is None:
        return y.output(0)
    groups = m.offsets.get_partial_shape()[-1].get_length()
    sums = ops.reduce_sum(ops.reshape(rows, const([0, groups, -1]), special_zero=True), const([-1]), keep_dims=False)
    return ops.add(y, opset17.grouped_matmul(sums, m.offsets, ends)).output(0)
