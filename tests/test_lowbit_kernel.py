"""vinoserve's low-bit matmul kernel (model/lowbit): an OpenVINO extension op the decode model's 4-
and 8-bit MatMuls run on. Its arithmetic is fixed (int8 activations per group, exact integer dot
products, the same float steps per row on every CPU that has the instructions), so it is checked
against that arithmetic in numpy, to float rounding."""
from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model import cpu_defaults, lowbit
from vinoserve.model.cpu_class import CpuClass
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.lowbit import build, pack
from vinoserve.model.paged import compile_paged
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams


def _matmul(rows: int, k: int, group: int, element: ov.Type, scale_type, offset_type, rng, bits: int | None = None):
    """MatMul(x, weight) with the weight chain weights.py writes, its integers of `bits` bits
    (default: the element type's, Q6_K's 6 in int8; "e2m1": MXFP4's values doubled, in int8); the weight's integers times their scales,
    and its offsets per group (or None), in f32."""
    e2m1, bits = bits == "e2m1", None if bits == "e2m1" else bits  # MXFP4's values doubled, as int8
    bits, signed = bits or element.bitwidth, element in (ov.Type.i4, ov.Type.i8)
    low = -(1 << (bits - 1)) if signed else 0
    q = rng.integers(low, low + (1 << bits), (rows, k // group, group))
    if e2m1:
        q = rng.choice(pack.E2M1_DOUBLED, (rows, k // group, group))
    if scale_type in ("k", "k6"):  # a K-quant's: an f16 per 256 weights times an integer per group, f32
        ints = (-128, 128) if signed and scale_type == "k" else (0, 64)  # "k6": Q4_K's 6-bit sub-scales
        scale = _k_factors(rng, rows, k // group, 256 // group, 0.0004, ints)
    else:
        scale = (rng.random((rows, k // group, 1)) * 0.02 + 0.001).astype(scale_type)
    w = ops.multiply(ops.convert(ops.constant(q.astype(np.int8 if signed else np.uint8), element),
                                 ov.Type.f16 if scale.dtype == np.float16 else ov.Type.f32), ops.constant(scale))
    scaled, offsets = (q * scale.astype(np.float32)).reshape(rows, k), None
    if offset_type is not None:
        if offset_type == "k":  # weights.py's centring of a K-quant's minimum: -dmin * m + 8 (Q5_K: 16) * scale
            offset = -_k_factors(rng, rows, k // group, 256 // group, 0.0002, (0, 64)) + (8 if bits == 4 else 16) * scale
        else:
            offset = (rng.standard_normal((rows, k // group, 1)) * 0.01).astype(offset_type)
        w = ops.add(w, ops.constant(offset))
        offsets = offset.astype(np.float32).reshape(rows, k // group)
    w = ops.convert(ops.reshape(w, ops.constant(np.array([rows, k])), False), ov.Type.f32)
    x = ops.parameter([-1, k], np.float32)
    return ov.Model([ops.matmul(x, w, False, True).output(0)], [x]), scaled, offsets


def _k_factors(rng, rows: int, groups: int, block: int, unit: float, ints: tuple[int, int]) -> np.ndarray:
    """f16 d per block times integers in [ints), one per block at the range's end of largest
    magnitude, as llama.cpp's quantizers leave them (63 for Q4_K, -128 for Q6_K)."""
    d = (rng.random((rows, groups // block, 1, 1)) * unit + unit / 4).astype(np.float16).astype(np.float32)
    q = rng.integers(*ints, (rows, groups // block, block, 1))
    q[:, :, 0] = ints[0] if ints[0] < 0 else ints[1] - 1
    return (d * q).reshape(rows, groups, 1).astype(np.float32)


def _int8_activations(x: np.ndarray, group: int) -> np.ndarray:
    """x as the kernel sees it: int8 per group, scale amax / 127, rounded to nearest even."""
    g = x.reshape(x.shape[0], -1, group)
    d = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    return (np.rint(g * inv) * d).reshape(x.shape)


@pytest.mark.parametrize("element,group,scale_type,offset_type", [
    (ov.Type.i4, 32, np.float16, None),        # Q4_0
    (ov.Type.i4, 32, np.float32, np.float32),  # Q4_1 (centred, an offset per block)
    (ov.Type.i4, 32, "k", "k"),                # its factors found again, int8 sub-scales
    (ov.Type.i4, 32, "k6", "k"),               # Q4_K: 6-bit sub-scales and minimums, kept in 6 bits
    ("q6", 16, "k", None),                     # Q6_K: int8 constants with 6-bit values, packed in 6 bits
    ("q5", 32, "k6", "k"),                     # Q5_K: 5-bit values, packed in 5 bits
    ("q6", 32, np.float16, None),
    (ov.Type.i8, 16, "k", None),               # Q6_K's scales with int8's whole range (8 bits)
    (ov.Type.i8, 32, "k", "k"),                # Q5_K
    (ov.Type.i8, 16, np.float32, None),        # f32 scales that have no factors
    (ov.Type.i8, 32, np.float16, None),        # Q8_0
    (ov.Type.u4, 16, np.float16, np.float16),
    (ov.Type.u8, 32, np.float16, np.float16),
    ("e2m1", 32, np.float32, None),            # MXFP4 (gpt-oss): 4-bit codes read through a table
])
def test_the_kernel_computes_its_arithmetic(kernel, element, group, scale_type, offset_type, monkeypatch):
    """The integers against x rounded to int8 per group, the offsets against x's exact group sums.
    200 rows (the last tile of 16 partial), 15 rows of x (the 8, 4, 2 and 1-row paths), and each
    row of x alone gives bit for bit what it gives in the batch."""
    rng = np.random.default_rng(7)
    bits = {"q5": 5, "q6": 6, "e2m1": "e2m1"}.get(element)
    element = ov.Type.i8 if bits else element
    model, scaled, offsets = _matmul(200, 512, group, element, scale_type, offset_type, rng, bits)
    core = ov.Core()
    assert lowbit.use_kernel(model, core) == 1
    assert [n.get_type_name() for n in model.get_ordered_ops()].count(lowbit.OP) == 1
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    x = rng.standard_normal((15, 512)).astype(np.float32)
    x[3] = 0  # a row of zeros: scale 0, no division by it
    y = compiled([x])[0]
    expected = _int8_activations(x, group).astype(np.float64) @ scaled.T.astype(np.float64)
    if offsets is not None:
        expected += x.reshape(15, -1, group).sum(-1).astype(np.float64) @ offsets.T.astype(np.float64)
    np.testing.assert_allclose(y, expected, rtol=0, atol=2e-5 * np.abs(expected).max())
    assert not np.any(y[3])
    for i in (0, 14):
        np.testing.assert_array_equal(compiled([x[i:i + 1]])[0][0], y[i])
    node, = (n for n in model.get_ordered_ops() if n.get_type_name() == lowbit.OP)
    assert (node.get_attributes()["block"] > 0) == (scale_type in ("k", "k6"))
    assert node.get_attributes()["factor_bits"] == (6 if scale_type == "k6" else 8)
    assert node.get_attributes()["bits"] == (4 if bits == "e2m1" else bits or element.bitwidth)
    assert node.get_attributes()["e2m1"] == (bits == "e2m1")
    if scale_type in ("k", "k6"):  # the factors give bit for bit what their f32 products give
        monkeypatch.setattr(pack, "factor", lambda s, block: None)
        plain, _, _ = _matmul(200, 512, group, element, scale_type, offset_type, np.random.default_rng(7), bits)
        assert lowbit.use_kernel(plain, core) == 1
        np.testing.assert_array_equal(core.compile_model(plain, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})([x])[0], y)


def test_f16_scales_reach_the_kernel_as_two_bytes(kernel):
    """The plugin widens an f16 constant to f32 when it compiles (Q4_0 would read 5 bits a weight,
    not the file's 4.5), so f16 scales and offsets are given as their bytes, as the weights are."""
    model, _, _ = _matmul(64, 256, 32, ov.Type.u4, np.float16, np.float16, np.random.default_rng(3))
    core = ov.Core()
    assert lowbit.use_kernel(model, core) == 1
    runtime = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).get_runtime_model()
    consts = [n for n in runtime.get_ordered_ops() if n.get_rt_info()["layerType"].astype(str) == "Const"]
    assert sorted(n.get_rt_info()["outputPrecisions"].astype(str) for n in consts) == ["u8"] * 3
    assert sorted(int(np.prod(n.get_output_partial_shape(0).to_shape())) for n in consts) == [64 * 8 * 2] * 2 + [64 * 256 // 2]


def _split_product(parts: list[int]) -> ov.Model:
    """A product whose columns a VariadicSplit cuts into `parts`, as fuse_projections leaves q/k/v."""
    model, _, _ = _matmul(96, 256, 32, ov.Type.i4, np.float16, None, np.random.default_rng(5))
    split = ops.variadic_split(model.get_results()[0].input_value(0), ops.constant(np.int64(-1)),
                               ops.constant(np.array(parts, np.int64)))
    return ov.Model([split.output(i) for i in range(len(parts))], model.get_parameters())


def test_a_split_product_stores_its_parts_as_outputs_of_its_own(kernel):
    """Parts of whole tiles: one kernel node with an output a part and no split node (no copy), the
    same numbers as the whole product's columns, in the paired and the one-tile paths; parts
    that cut a tile keep the split."""
    core = ov.Core()
    whole, _, _ = _matmul(96, 256, 32, ov.Type.i4, np.float16, None, np.random.default_rng(5))
    assert lowbit.use_kernel(whole, core) == 1
    split = _split_product([32, 48, 16])
    assert lowbit.use_kernel(split, core) == 1
    assert [n.get_type_name() for n in split.get_ordered_ops()].count("VariadicSplit") == 0
    (node,) = (n for n in split.get_ordered_ops() if n.get_type_name() == lowbit.OP)
    assert node.get_output_size() == 3 and list(node.get_attributes()["parts"]) == [32, 48, 16]
    x = np.random.default_rng(6).standard_normal((13, 256)).astype(np.float32)
    compiled = [core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}) for m in (whole, split)]
    for rows in (1, 13):  # one tile at a time, tiles in pairs
        y = compiled[0]([x[:rows]])[0]
        parts = compiled[1]([x[:rows]])
        for i, (start, end) in enumerate([(0, 32), (32, 80), (80, 96)]):
            np.testing.assert_array_equal(parts[i], y[:, start:end])
    uneven = _split_product([40, 56])
    assert lowbit.use_kernel(uneven, core) == 1
    assert [n.get_type_name() for n in uneven.get_ordered_ops()].count("VariadicSplit") == 1


def _two_planes(x: np.ndarray, group: int) -> np.ndarray:
    """x as the kernel sees it in two planes: its int8 rounding plus that of what the rounding
    left, at a 256th of the first's scale (saturating at 127)."""
    g = x.reshape(x.shape[0], -1, group)
    d = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    first = np.rint(g * inv) * d
    fine = np.clip(np.rint((g - first) * (inv * np.float32(256))), -127, 127) * (d / np.float32(256))
    return (first + fine).reshape(x.shape)


@pytest.mark.parametrize("element,group,scale_type,offset_type", [
    (ov.Type.i4, 32, np.float16, None),        # Q4_0
    (ov.Type.i4, 32, np.float32, np.float32),  # Q4_1
    (ov.Type.i8, 16, "k", None),               # Q6_K
])
def test_the_planes_input_quantizes_x_in_two_planes_or_one(kernel, element, group, scale_type, offset_type):
    """With 2 on the planes input (a step with prompt tokens), x is its int8 rounding plus the
    rounding of what that left: some 2^-16 of a group's largest value off rather than 2^-8,
    closer to f32 than bf16; with 1 (decode steps, however many rows) one plane, as before."""
    rng = np.random.default_rng(11)
    source, scaled, offsets = _matmul(200, 512, group, element, scale_type, offset_type, rng)
    # a layer's product, which does not give the outputs themselves
    planes = ops.parameter([], ov.Type.i32)
    hidden = ov.Model([ops.add(source.get_results()[0].input_value(0), ops.constant(np.float32(0))).output(0)],
                      [*source.get_parameters(), planes])
    del source  # and its Result
    core = ov.Core()
    assert lowbit.use_kernel(hidden, core, planes.output(0)) == 1
    model = core.compile_model(hidden, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})

    def compiled(inputs: list[np.ndarray], count: int = 2) -> list[np.ndarray]:
        return model([*inputs, np.array(count, np.int32)])
    x = rng.standard_normal((15, 512)).astype(np.float32)

    def product(seen: np.ndarray) -> np.ndarray:
        y = seen.astype(np.float64) @ scaled.T.astype(np.float64)
        if offsets is not None:
            y += x[:len(seen)].reshape(len(seen), -1, group).sum(-1).astype(np.float64) @ offsets.T.astype(np.float64)
        return y

    y, exact = compiled([x])[0], product(x)
    np.testing.assert_allclose(y, product(_two_planes(x, group)), rtol=0, atol=2e-5 * np.abs(exact).max())
    one_plane = product(_int8_activations(x, group))
    assert np.abs(y - exact).max() < np.abs(one_plane - exact).max() / 20
    np.testing.assert_allclose(compiled([x], 1)[0], one_plane, rtol=0, atol=2e-5 * np.abs(exact).max())
    for rows in (3, 13, 14):  # unpaired tiles, and the paired blocks' tails: each row as in the batch
        np.testing.assert_array_equal(compiled([x[:rows]], 2)[0], y[:rows])
    logits, _, _ = _matmul(200, 512, group, element, scale_type, offset_type, np.random.default_rng(11))
    # the logits' product: two planes whatever the input says (it reads none)
    assert lowbit.use_kernel(logits, core, ops.parameter([], ov.Type.i32).output(0)) == 1
    one_row = core.compile_model(logits, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})([x[:1]])[0]
    np.testing.assert_allclose(one_row, product(_two_planes(x[:1], group)), rtol=0, atol=2e-5 * np.abs(exact).max())


def test_in_a_step_of_two_planes_the_mlps_gate_and_up_take_two_on_the_sampled_rows_alone(kernel):
    """A product feeding an activation (gate, fused with up) reads the rows whose logits the step
    reads (paged.SAMPLED_INDICES): in a step of two planes those rows take two and the others one,
    each bit for bit as in a step that gives all rows the same count; in a step of one, all one."""
    rng = np.random.default_rng(12)
    source, scaled, _ = _matmul(192, 512, 32, ov.Type.i4, np.float16, None, rng)
    split = ops.variadic_split(source.get_results()[0].input_value(0), ops.constant(np.int64(-1)),
                               ops.constant(np.array([96, 96], np.int64)))
    sampled = ops.parameter([-1], ov.Type.i64)
    planes = ops.parameter([], ov.Type.i32)
    model = ov.Model([ops.swish(split.output(0)).output(0), split.output(1)],
                     [*source.get_parameters(), sampled, planes])
    del source  # and its Result
    core = ov.Core()
    assert lowbit.use_kernel(model, core, planes.output(0), sampled=sampled.output(0)) == 1
    node, = (n for n in model.get_ordered_ops() if n.get_type_name() == lowbit.OP)
    assert node.get_attributes()["sampled"] == 1 and node.get_attributes()["planes"] == 0
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    x = rng.standard_normal((23, 512)).astype(np.float32)

    def up(rows: list[int], count: int) -> np.ndarray:
        return compiled([x, np.array(rows, np.int64), np.array(count, np.int32)])[1]
    every = list(range(len(x)))
    fine, coarse = up(every, 2), up(every, 1)
    exact = x.astype(np.float64) @ scaled[96:].T.astype(np.float64)
    tol = 2e-5 * np.abs(exact).max()
    np.testing.assert_allclose(fine, _two_planes(x, 32).astype(np.float64) @ scaled[96:].T.astype(np.float64), rtol=0, atol=tol)
    np.testing.assert_allclose(coarse, _int8_activations(x, 32).astype(np.float64) @ scaled[96:].T.astype(np.float64),
                               rtol=0, atol=tol)
    # out of range and repeated indices ignored; 21 rows in pairs of tiles, 2 a tile at a time
    mixed = up([20, 4, 20, -1, 99], 2)
    for r in every:
        np.testing.assert_array_equal(mixed[r], (fine if r in (4, 20) else coarse)[r])
    np.testing.assert_array_equal(up([4, 20], 1), coarse)  # a step of one plane: every row one
    np.testing.assert_array_equal(up([], 2), coarse)  # none sampled: every row one
    np.testing.assert_array_equal(up([0], 2)[:1], fine[:1])


@pytest.fixture(scope="module")
def q4_k(tmp_path_factory) -> GGUFModel:
    """A tiny Llama llama-quantize made Q4_K_M: Q4_K, Q5_K (offsets), Q6_K (groups of 16)."""
    return GGUFModel.open(Path(__file__).parent / "data" / "llamacpp-tiny-llama-Q4_K_M.gguf")


def test_the_decode_model_runs_its_low_bit_matmuls_on_the_kernel(kernel, q4_k):
    """Every projection of the decode model and the LM head, whatever their types (this file mixes
    three, so q/k/v and gate/up stay apart), offsets included; the main compilation keeps the
    plugin's kernels."""
    options = CompileOptions(inference_precision="f32", decode_model=True)
    model = compile_paged(build_model(q4_k.config, q4_k.tensor, "auto"), options)
    assert model.decode_graph.kernel_matmuls == 2 * 6 + 1  # 2 layers' 6 products, the LM head

    def layer_types(compiled: ov.CompiledModel) -> list[str]:
        return [n.get_rt_info()["layerType"].astype(str) for n in compiled.get_runtime_model().get_ordered_ops()]

    decode, main = layer_types(model.decode), layer_types(model.compiled)
    assert decode.count("Reference") == 2 * 6 + 1  # the extension's nodes (the token table stays the plugin's gather)
    assert not any(t.startswith("FullyConnected") for t in decode)  # no weight left to the plugin's matmuls
    assert "Reference" not in main and any(t.startswith("FullyConnected") for t in main)


def test_k_quant_products_keep_the_files_factors(kernel, q4_k):
    """Q4_K, Q5_K and Q6_K: an f16 per 256 weights and an integer per group, Q4_K's and Q5_K's in
    6 bits as the file keeps them (0.5625 bytes a Q4_K weight, the file's, where their f32 products
    take 0.75), Q6_K's in 8; the other products' floats as they are. Q5_K's and Q6_K's values,
    int8 in the graph, in 5 and 6 bits. Every one reads the file's bytes."""
    model = build_model(q4_k.config, q4_k.tensor, "auto")
    assert lowbit.use_kernel(model, ov.Core()) == 2 * 7 + 1
    nodes = [n for n in model.get_ordered_ops() if n.get_type_name() == lowbit.OP]
    layouts = collections.Counter(tuple(n.get_attributes()[a] for a in ("bits", "group", "block", "factor_bits")) for n in nodes)
    assert layouts == {(4, 32, 8, 6): 10, (5, 32, 8, 6): 2, (6, 16, 16, 8): 3}  # Q4_K, Q5_K, Q6_K (the LM head's too)
    for n in nodes:
        weights = -(-n.get_attributes()["n"] // 16) * 16 * n.get_attributes()["k"]  # rows in whole tiles
        read = sum(n.input_value(i).get_node().get_byte_size() for i in range(1, n.get_input_size()))
        assert read * 8 / weights == {4: 4.5, 5: 5.5, 6: 6.5625}[n.get_attributes()["bits"]]  # the file's


def test_scales_factor_only_where_the_products_come_back_exactly():
    rng = np.random.default_rng(3)
    s = _k_factors(rng, 64, 16, 8, 0.0004, (0, 64)).reshape(64, 16)
    d, q = pack.factor(s, 8)
    assert d.dtype == np.float16 and q.dtype == np.int8
    np.testing.assert_array_equal(np.repeat(d.astype(np.float32), 8, axis=1) * q, s)
    assert pack.factor_bits(q) == 6
    d, q = pack.factor(-s, 8)  # a minimum's -dmin * m: negated factors, so its integers take 6 bits too
    np.testing.assert_array_equal(np.repeat(d.astype(np.float32), 8, axis=1) * q, -s)
    assert q.min() >= 0 and pack.factor_bits(q) == 6
    assert pack.factor(rng.random((64, 16)).astype(np.float32), 8) is None  # not a K-quant's
    assert pack.factor(np.full((4, 8), 1e30, np.float32), 8) is None  # beyond f16
    assert not pack.factor(np.zeros((4, 8), np.float32), 8)[1].any()


def test_a_cold_cache_builds_a_library_openvino_loads(kernel, tmp_path, monkeypatch):
    """What a first start does: compile this CPU's path into the cache, keyed by the compiler too,
    and load it; a second start finds it."""
    monkeypatch.setenv("VINOSERVE_CACHE", str(tmp_path))
    build.library.cache_clear()
    try:
        path = build.library()
        assert path.is_file() and path.is_relative_to(tmp_path)
        assert path.parent.name.startswith(build.source_key(build.isa()) + "-")  # and the compiler's key
        build.library.cache_clear()
        assert build.library() == path  # built once
    finally:
        build.library.cache_clear()


def test_where_it_cannot_be_built_the_plugin_runs_or_the_flag_fails_clearly(q4_k, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++ or g++ either
    monkeypatch.setenv("VINOSERVE_CACHE", str(tmp_path / "cache"))
    build.library.cache_clear()
    try:
        model = compile_paged(build_model(q4_k.config, q4_k.tensor, "auto"),
                              CompileOptions(inference_precision="f32", decode_model=True))
        assert model.decode is not None and model.decode_graph.kernel_matmuls == 0
        assert model.decode_graph.kernel_unavailable  # said in the startup log
        with pytest.raises(ModelLoadError, match="low-bit kernel was asked for"):
            compile_paged(build_model(q4_k.config, q4_k.tensor, "auto"),
                          CompileOptions(inference_precision="f32", decode_model=True, lowbit_kernel=True))
    finally:
        build.library.cache_clear()


def _as_avx512_bf16(monkeypatch) -> None:
    """The CPU class whose defaults put the main compilation on the kernel (Zen 4 and 5), on any
    CPU the kernel runs on."""
    monkeypatch.setattr(cpu_defaults, "this_cpu", lambda: CpuClass.AVX512_BF16)


def test_on_avx512_bf16_one_f32_compilation_runs_every_low_bit_matmul_on_the_kernel(kernel, q4_k, monkeypatch):
    """No decode model and no second copy: the plugin multiplies no weight of the main
    compilation; prompts' calls quantize x in two planes, decode steps' in one, the logits' in
    two always; the cache is f16."""
    _as_avx512_bf16(monkeypatch)
    graph = build_model(q4_k.config, q4_k.tensor, "auto")
    model = compile_paged(graph, CompileOptions())
    assert model.options.lowbit_main and model.decode_graph is None and model.inference_precision == "f32"
    assert model.main_kernel.matmuls == 2 * 6 + 1 and "13 matmuls on vinoserve's low-bit kernel" in model.describe()
    assert model.decode_tokens == 1  # the one-token clone of this compilation, not a decode model (test_one_token.py)
    assert model.layout.key_type == ov.Type.f16
    types = [n.get_rt_info()["layerType"].astype(str) for n in model.compiled.get_runtime_model().get_ordered_ops()]
    assert types.count("Reference") == 2 * 6 + 1 + 1 and not any(t.startswith("FullyConnected") for t in types)
    assert "GatherCompressed" not in types  # the Q4_K token table's rows: the library's gather (test_lowbit_gather.py)
    assert [n.get_type_name() for n in graph.get_ordered_ops()].count("LowBitGather") == 1
    planes = collections.Counter((n.get_attributes()["planes"], n.get_attributes()["sampled"])
                                 for n in graph.get_ordered_ops() if n.get_type_name() == lowbit.OP)
    # each step's count from the lowbit_planes input (each layer's gate with up: two on the
    # sampled rows only); the LM head: always two
    assert planes == {(0, 0): 2 * 5, (0, 1): 2, (2, 0): 1}
    assert {n.get_attributes()["prefetch"] for n in graph.get_ordered_ops() if n.get_type_name() == lowbit.OP} == {4096}
    assert lowbit.PLANES in model.input_names


def test_on_avx2_a_prompts_rows_take_two_planes_in_q_k_v_and_where_their_logits_are_read(kernel, q4_k, monkeypatch):
    """The AVX2 and AVX-512 classes: in a step of two planes every product but the attention's
    q/k/v (which fill the cache) and the logits' takes two on the sampled rows only."""
    monkeypatch.setattr(cpu_defaults, "this_cpu", lambda: CpuClass.AVX2)
    graph = build_model(q4_k.config, q4_k.tensor, "auto")
    model = compile_paged(graph, CompileOptions())
    assert model.options.lowbit_main and model.options.lowbit_coarse == "all_but_qkv"
    planes = collections.Counter((n.get_attributes()["planes"], n.get_attributes()["sampled"])
                                 for n in graph.get_ordered_ops() if n.get_type_name() == lowbit.OP)
    # q/k/v: one fused product in the first layer, three apart in the second (their types differ);
    # o, gate, up, down in each; the LM head
    assert planes == {(0, 0): 1 + 3, (0, 1): 2 * 4, (2, 0): 1}


def test_on_avx512_bf16_without_the_kernel_the_bf16_compilation_runs(q4_k, tmp_path, monkeypatch):
    _as_avx512_bf16(monkeypatch)
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("VINOSERVE_CACHE", str(tmp_path / "cache"))
    build.library.cache_clear()
    try:
        model = compile_paged(build_model(q4_k.config, q4_k.tensor, "auto"), CompileOptions())
        assert not model.options.lowbit_main and model.options.inference_precision is None
        assert "the plugin's matmuls (" in model.describe()  # and why, in the startup log
        with pytest.raises(ModelLoadError, match="low-bit kernel was asked for"):
            compile_paged(build_model(q4_k.config, q4_k.tensor, "auto"), CompileOptions(lowbit_kernel=True))
    finally:
        build.library.cache_clear()


@pytest.mark.parametrize("flag,value", [("auto", None), ("on", True), ("off", False)])
def test_the_flag_reaches_the_compile_options(flag, value):
    from vinoserve.cli import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--lowbit-kernel", flag])
    assert _engine_config(args).compile.lowbit_kernel is value


def test_steps_with_prompt_tokens_take_two_planes_decode_steps_one(kernel, monkeypatch):
    """The runner sets lowbit_planes a step at a time: 2 where the step computes prompt tokens or
    one sequence decodes, 1 where several sequences only decode (a step of 40 costs one plane's
    dot products, not two)."""
    _as_avx512_bf16(monkeypatch)
    path = str(Path(__file__).parent / "data" / "llamacpp-tiny-llama-Q4_K_M.gguf")
    engine = LLMEngine(EngineConfig(model=path, speculative=None), log=lambda m: None)
    assert engine.model.paged.options.lowbit_main
    seen: list[tuple[list[bool], int]] = []  # a step's chunks (prompt tokens or not), its planes
    prepare = ModelRunner.prepare

    def spy(self, chunks, rotation=None):
        step = prepare(self, chunks, rotation)
        assert all(c.prompt == (c.past_len < 20) for c in chunks)  # the 20-token prompts' chunks
        seen.append(([c.prompt for c in chunks], int(step.inputs[lowbit.PLANES])))
        return step
    monkeypatch.setattr(ModelRunner, "prepare", spy)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(40):
        engine.add_request(str(i), list(range(10 + i, 30 + i)), params)
    while engine.has_unfinished_requests:
        engine.step()
    assert all(planes == (2 if any(prompt) or len(prompt) == 1 else 1) for prompt, planes in seen)
    assert ([False] * 40, 1) in seen and any(planes == 2 for _, planes in seen)
    assert ModelRunner.planes([ScheduledChunk([5], 20, [[0]], prompt=False)]) == 2  # one sequence decoding
