"""Quantized GGUF weights kept as OpenVINO low-bit constants (`auto`), requantized (`int4`), and
our K-quant fixture encoder checked against gguf-py's dequantize."""
from __future__ import annotations

import sys

import gguf
import numpy as np
import openvino as ov
import pytest

from vinoserve.bench import kquants as kquant_encoder
from gguf_fixtures import tiny_hf_model, write_gguf
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model import quantized
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.paged import compile_paged
from vinoserve.model.compile_options import CompileOptions

T = gguf.GGMLQuantizationType
# f32 compute also turns the plugin's int8 activations off (CompileOptions.properties): f32 arithmetic.
F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
KEPT = {T.Q4_0: "i4", T.Q4_1: "i4", T.Q5_0: "i8", T.Q5_1: "i8", T.Q8_0: "i8",
        T.Q4_K: "i4", T.Q5_K: "i8", T.Q6_K: "i8"}
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _values(b: quantized.Blocks) -> np.ndarray:
    """What the graph's decompression computes, in numpy (float64: no rounding of our own)."""
    q = b.q
    if b.element.bitwidth == 4:
        q = np.stack([q & 0x0F, q >> 4], axis=-1).reshape(*q.shape[:2], -1).astype(np.int16)
        if b.element == ov.Type.i4:
            q = np.where(q > 7, q - 16, q)
    w = q.astype(np.float64) * b.scale.astype(np.float64)
    if b.offset is not None:
        w = w + b.offset.astype(np.float64)
    return w.reshape(b.shape)


def _raw(qtype: T, x: np.ndarray, exact_scales: bool = False) -> np.ndarray:
    if qtype in kquant_encoder.ENCODERS:
        return kquant_encoder.quantize(x, qtype, exact_scales)
    return gguf.quants.quantize(x, qtype)


@pytest.mark.parametrize("qtype", list(kquant_encoder.ENCODERS))
def test_kquant_encoder_round_trips_through_gguf_dequantize(qtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 512)).astype(np.float32) * 0.05
    x[0, :256] = np.abs(x[0, :256])  # a super-block with no negative values: a zero min
    for exact in (False, True):
        raw = kquant_encoder.quantize(x, qtype, exact)
        assert raw.shape == (8, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
        back = gguf.quants.dequantize(raw, qtype).reshape(x.shape)
        levels = {T.Q4_K: 15, T.Q5_K: 31, T.Q6_K: 62}[qtype]
        # within about a quantization step of the block's range (6-bit sub-scales round it)
        step = np.ptp(x.reshape(-1, 32 if qtype != T.Q6_K else 16), axis=1).max() / levels
        assert np.abs(back - x).max() <= 1.5 * step, (exact, np.abs(back - x).max(), step)
        assert np.abs(back - x).mean() <= 0.3 * step


@pytest.mark.parametrize("qtype", list(KEPT))
def test_unpacked_blocks_are_the_files_values(qtype):
    """Every layout gives gguf-py's dequantized values: exactly, or for types with a minimum (centred:
    their offsets are sums formed in f32) to f32's rounding."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 512)).astype(np.float32) * 0.05
    raw = _raw(qtype, x)
    ref = gguf.quants.dequantize(raw, qtype).reshape(x.shape).astype(np.float64)
    blocks = quantized.unpack(qtype, raw)
    assert blocks.element.get_type_name() == KEPT[qtype]
    got = _values(blocks)
    if blocks.offset is not None:
        assert np.abs(got - ref).max() <= 2.0 ** -22 * np.abs(ref).max()
    else:
        np.testing.assert_array_equal(got, ref)


def _logits(src: GGUFModel, weights: str, ids: list[int], options: CompileOptions = F32,
            graph: ov.Model | None = None) -> np.ndarray:
    model = compile_paged(graph or build_model(src.config, src.tensor, weights), options)
    runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=4))
    return runner.step([ScheduledChunk(ids, 0, [[0, 1]], num_logits=len(ids))]).logits[0].copy()


def _weight_types(graph: ov.Model) -> dict[str, str]:
    return {n.get_friendly_name(): n.get_element_type().get_type_name() for n in graph.get_ordered_ops()
            if n.get_type_name() == "Constant" and n.get_friendly_name().startswith(("blk.", "model.", "lm_head"))}


def _tiny(qtype: T, tie: bool, tmp_path):
    big = qtype in kquant_encoder.ENCODERS  # K-quant rows are multiples of 256 values
    hf = tiny_hf_model("llama", tie=tie, hidden=256 if big else 64, intermediate=512 if big else 96)
    return GGUFModel.open(write_gguf(hf, tmp_path / f"{qtype.name}.gguf", quant=qtype.name))


@pytest.mark.parametrize("qtype,tie", [(t, False) for t in KEPT] + [(T.Q4_1, True), (T.Q4_K, True)])
def test_auto_keeps_each_type_low_bit_and_computes_the_dequantized_model(qtype, tie, tmp_path):
    """At f32 compute the `auto` graph (low-bit constants; a block's min split off at load time,
    a tied table's too) gives the logits of the same GGUF dequantized to f32."""
    src = _tiny(qtype, tie, tmp_path)
    graph = build_model(src.config, src.tensor, "auto")
    types = _weight_types(graph)
    for name in [f"blk.{i}.{m}" for i in range(src.config.num_layers) for m in MATRICES] + ["model.embed_tokens.weight"]:
        assert types[name] == KEPT[qtype], (name, types[name])
    ids = list(range(10, 60))
    got = _logits(src, "auto", ids, graph=graph)
    ref = _logits(src, "f32", ids)
    np.testing.assert_allclose(got, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=0)


def test_int4_requantizes_a_float_file_to_i4_groups(tmp_path):
    """`int4` on an f16 GGUF: matrices as i4 groups of 32, tables as i8 groups of 32: the model
    llama.cpp's Q4_0 quantizer would make (tables Q8_0), computed exactly."""
    hf = tiny_hf_model("llama", tie=False)
    src = GGUFModel.open(write_gguf(hf, tmp_path / "f16.gguf"))
    q4 = GGUFModel.open(write_gguf(hf, tmp_path / "q4_0.gguf", quant="Q4_0",
                                   q8_0=("token_embd.weight", "output.weight")))
    graph = build_model(src.config, src.tensor, "int4")
    types = _weight_types(graph)
    assert {types[f"blk.{i}.{m}"] for i in range(src.config.num_layers) for m in MATRICES} == {"i4"}
    assert types["model.embed_tokens.weight"] == types["lm_head.weight"] == "i8"
    ids = list(range(10, 60))
    np.testing.assert_allclose(_logits(src, "int4", ids, graph=graph), _logits(q4, "f32", ids), atol=1e-4, rtol=0)


def test_fused_projections_of_4bit_blocks_with_offsets_give_identical_logits(tmp_path):
    """q/k/v merge as packed u4 blocks (fuse_projections), their offset corrections already one
    product (block_offsets): bit-identical logits, two FullyConnected fewer per layer."""
    src = _tiny(T.Q4_1, False, tmp_path)
    ids = list(range(10, 60))
    counts, logits = [], []
    for fuse in (False, True):
        options = CompileOptions(inference_precision="f32", kv_cache_precision="f32", fuse_projections=fuse)
        model = compile_paged(build_model(src.config, src.tensor, "auto"), options)
        counts.append(sum(op.get_rt_info()["layerType"].astype(str) == "FullyConnected"
                          for op in model.compiled.get_runtime_model().get_ordered_ops()))
        runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=4))
        logits.append(runner.step([ScheduledChunk(ids, 0, [[0, 1]], num_logits=len(ids))]).logits[0].copy())
    assert counts[0] - counts[1] == 2 * src.config.num_layers
    np.testing.assert_array_equal(logits[1], logits[0])


def _resident_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside, target = 0, False, str(path.resolve())
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = line.rstrip().endswith(target)
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_engine_keeps_no_resident_pages_of_the_ir_weights(tmp_path):
    """The plugin packs its own copy of the weights in the engine's warm-up; the IR file's mapped
    pages it read to do so are given back. (Small matrices, as here, may be read in place at one
    token a step: those pages come back with the first decode; a 1.5B model's do not.)"""
    from vinoserve.engine.llm_engine import EngineConfig, LLMEngine

    path = write_gguf(tiny_hf_model("llama"), tmp_path / "q4.gguf", quant="Q4_1")
    engine = LLMEngine(EngineConfig(model=str(path), compile=F32, num_kv_blocks=16), log=lambda m: None)
    weights = engine.model.path / "openvino_model.bin"
    assert weights.stat().st_size > 32 << 10
    assert _resident_kib(weights) == 0


def test_requantizing_a_slice_of_rows_at_a_time_gives_the_whole_tensors_bytes(monkeypatch):
    """int8 and int4 dequantize a few rows at a time (an 8B token table in f32 would be 2.1 GB);
    rows are independent, so the constants are those of the whole tensor at once."""
    from vinoserve.model import weights
    from vinoserve.model.gguf_file import GGUFTensor

    x = np.random.default_rng(0).normal(0, 0.02, (37, 64)).astype(np.float32)
    t = GGUFTensor("w", T.Q4_1, gguf.quants.quantize(x, T.Q4_1), x.shape)
    monkeypatch.setattr(weights, "_ROWS_PER_REQUANT", 8)  # 5 slices, the last a short one

    def constants(out: ov.Output) -> list[bytes]:
        model = ov.Model([ov.opset13.result(out)], [])
        return [op.get_data().tobytes() for op in model.get_ordered_ops()  # the weights', not shapes
                if op.get_type_name() == "Constant" and op.get_output_element_type(0) != ov.Type.i64]

    q, zp, scale = weights._int8_rows(t.dequantize())  # the whole tensor at once
    assert constants(weights.Weights("int8").matrix(t, "w")) == [q.tobytes(), zp.tobytes(), scale.tobytes()]
    whole = quantized.unpack(T.Q4_0, gguf.quants.quantize(t.dequantize(), T.Q4_0))
    assert constants(weights.Weights("int4").matrix(t, "w")) == [whole.q.tobytes(), whole.scale.tobytes()]
