"""A mixture of experts' products on vinoserve's kernel (model/lowbit/experts.py, LowBitExperts):
each expert's run of rows against its own matrix of the stacked chain model/moe.py builds, with
the kernel's arithmetic (checked against numpy; an expert's rows give bit for bit the same
alone as among others'), block minimums inside the product, empty experts skipped.
The families through the engine on it: test_moe_families.py."""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import openvino.opset17 as opset17
import pytest

from test_lowbit_kernel import _int8_activations, _k_factors
from vinoserve.model import lowbit, moe
from vinoserve.model.lowbit import pack

E, N, K = 5, 48, 256  # 48 rows an expert: a pair of tiles and one alone
# rows of x per expert, in order: one empty, one with the pair path's 8 rows and more, one row
COUNTS = [3, 0, 11, 1, 6]


def _experts(rng, group: int, scale_type, offset: bool, element: ov.Type = ov.Type.i4, e2m1: bool = False):
    """GroupedMatMul over a stacked chain as model/moe.py builds it, and each expert's integers
    times scales [E, N, K] and offsets [E, N, K / group] (or None), f32. `e2m1`: int8 values that
    are MXFP4's doubled, as weights.py keeps gpt-oss' experts."""
    groups = K // group
    signed = element in (ov.Type.i4, ov.Type.i8)
    low = -(1 << (element.bitwidth - 1)) if signed else 0
    q = rng.integers(low, low + (1 << element.bitwidth), (E, N, groups, group))
    if e2m1:
        q = rng.choice(pack.E2M1_DOUBLED, (E, N, groups, group))
    if scale_type == "k":
        scale = _k_factors(rng, E * N, groups, 256 // group, 0.0004, (0, 64)).reshape(E, N, groups, 1)
    else:
        scale = (rng.random((E, N, groups, 1)) * 0.02 + 0.001).astype(scale_type)
    w = ops.multiply(ops.convert(ops.constant(q.astype(np.int8 if signed else np.uint8), element),
                                 ov.Type.f16 if scale.dtype == np.float16 else ov.Type.f32), ops.constant(scale))
    values = ops.convert(ops.reshape(w, ops.constant(np.array([E, N, K])), False), ov.Type.f32).output(0)
    offsets = None
    if offset:  # weights.py's centring of a K-quant's minimum, as Weights.experts hands it apart
        offsets = (-_k_factors(rng, E * N, groups, 256 // group, 0.0002, (0, 64)).reshape(E, N, groups, 1)
                   + 8 * scale.astype(np.float32)).reshape(E, N, groups).astype(np.float32)
    x = ops.parameter([-1, K], ov.Type.f32, name="x")
    ends = ops.parameter([E], ov.Type.i32, name="ends")
    m = moe.ExpertMatrices(values, None if offsets is None else ops.constant(offsets).output(0))
    model = ov.Model([moe._product(x.output(0), m, ends.output(0))], [x, ends])
    return model, (q * scale.astype(np.float32)).reshape(E, N, K), offsets


def _compile(model: ov.Model, planes: int | None = None) -> ov.CompiledModel:
    core = ov.Core()
    scalar = None
    if planes is not None:
        scalar = ops.parameter([], ov.Type.i32, name="planes")
        scalar.output(0).set_names({"planes"})
        model.add_parameters([scalar])
    assert lowbit.use_kernel(model, core, None if scalar is None else scalar.output(0)) == 1
    assert lowbit.experts.count(model) == 1
    assert not any(n.get_type_name() == "GroupedMatMul" for n in model.get_ordered_ops())  # offsets' product too
    return core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


@pytest.mark.parametrize("group,scale_type,offset,element,e2m1", [
    (32, np.float16, False, ov.Type.i4, False),  # Q4_0
    (32, "k", True, ov.Type.i4, False),          # Q4_K: factored scales, block minimums
    (32, np.float32, True, ov.Type.i4, False),   # Q4_1
    (16, "k", False, ov.Type.i8, False),         # Q6_K's int8 (kept in 6 bits where its values fit)
    (32, np.float16, False, ov.Type.i8, False),  # Q8_0
    (32, np.float32, False, ov.Type.i8, True),   # MXFP4's doubled values: kept as 4-bit E2M1 codes
], ids=["q4_0", "q4_k", "q4_1", "q6_k", "q8_0", "mxfp4"])
def test_each_experts_rows_get_the_kernels_arithmetic_on_its_matrix(kernel, group, scale_type, offset, element, e2m1):
    rng = np.random.default_rng(5)
    model, scaled, offsets = _experts(rng, group, scale_type, offset, element, e2m1)
    compiled = _compile(model)
    node, = (n for n in model.get_ordered_ops() if n.get_type_name() == lowbit.experts.OP)
    attributes = node.get_attributes()
    assert (attributes["e2m1"], attributes["bits"] == 4) == (int(e2m1), e2m1 or element.bitwidth == 4)
    x = rng.standard_normal((sum(COUNTS), K)).astype(np.float32)
    ends = np.cumsum(COUNTS).astype(np.int32)
    y = compiled({"x": x, "ends": ends})[0]
    assert y.shape == (len(x), N)
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        rows = x[start:end]
        if not len(rows):  # an expert no row was routed to
            continue
        expected = _int8_activations(rows, group).astype(np.float64) @ scaled[e].T.astype(np.float64)
        if offsets is not None:
            expected += rows.reshape(len(rows), -1, group).sum(-1).astype(np.float64) @ offsets[e].T.astype(np.float64)
        np.testing.assert_allclose(y[start:end], expected, rtol=0, atol=2e-5 * np.abs(expected).max())
        # its rows alone (every row routed to it) give bit for bit the same: no other expert's rows
        # or tiles reach its outputs
        alone = np.zeros(E, np.int32)
        alone[e:] = end - start
        np.testing.assert_array_equal(compiled({"x": rows, "ends": alone})[0], y[start:end])


def test_two_planes_come_near_f32_and_no_rows_is_no_output(kernel):
    """In two int8 planes (a prompt's, or one sequence's step where the runner says so) the
    products are f32's to ~2^-16 of a group's largest input; a step with no rows gives none."""
    rng = np.random.default_rng(6)
    model, scaled, _ = _experts(rng, 32, np.float16, False)
    compiled = _compile(model, planes=2)
    x = rng.standard_normal((sum(COUNTS), K)).astype(np.float32)
    ends = np.cumsum(COUNTS).astype(np.int32)
    expected = np.concatenate([x[s:t].astype(np.float64) @ scaled[e].T.astype(np.float64)
                               for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends))])
    for planes, tolerance in ((2, 1e-4), (1, 3e-2)):
        y = compiled({"x": x, "ends": ends, "planes": np.array(planes, np.int32)})[0]
        assert np.abs(y - expected).max() <= tolerance * np.abs(expected).max()
    empty = compiled({"x": np.zeros((0, K), np.float32), "ends": np.zeros(E, np.int32),
                      "planes": np.array(1, np.int32)})
    assert empty[0].shape == (0, N)


def test_experts_of_rows_not_whole_tiles_stay_the_plugins():
    """An expert's rows must be whole tiles of 16 (a tile never holds two experts'): where they
    are not, the GroupedMatMul is left to the plugin."""
    x = ops.parameter([-1, 64], ov.Type.f32)
    q = ops.constant(np.zeros((2, 24, 2, 32), np.int8), ov.Type.i4)
    w = ops.multiply(ops.convert(q, ov.Type.f16), ops.constant(np.ones((2, 24, 2, 1), np.float16)))
    values = ops.convert(ops.reshape(w, ops.constant(np.array([2, 24, 64])), False), ov.Type.f32)
    ends = ops.parameter([2], ov.Type.i32)
    model = ov.Model([opset17.grouped_matmul(x, values, ends)], [x, ends])
    assert lowbit.experts.replace_experts(model, _factory()) == 0


def _factory():
    from openvino.utils.node_factory import NodeFactory

    from vinoserve.model.lowbit.build import library

    factory = NodeFactory()
    factory.add_extension(str(library()))
    return factory
