"""Graphs built from GGUF match HF transformers, driven through PagedAttention like the engine does."""
from __future__ import annotations

import numpy as np
import openvino as ov
import pytest
import torch

from gguf_fixtures import FAMILIES, family_gguf, tiny_hf_model, write_gguf
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model.gguf_file import GGUFTensor
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.paged import compile_paged
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.rope import RopeConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

SHAPES = {
    "llama-gqa-untied": dict(arch="llama", heads=4, kv_heads=2, tie=False),
    "llama-mha-tied": dict(arch="llama", heads=4, kv_heads=4, tie=True, rope_theta=100000.0),
    "llama-mqa-linear-rope": dict(arch="llama", heads=4, kv_heads=1, tie=False,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3-rope-scaling": dict(arch="llama", heads=4, kv_heads=2, tie=True, rope_theta=500000.0,
                                rope_scaling=LLAMA3_SCALING),
    "qwen2-qkv-bias": dict(arch="qwen2", heads=4, kv_heads=2, tie=True, rope_theta=1000000.0),
    "mistral-gqa": dict(arch="mistral", heads=4, kv_heads=2, tie=False),
    **FAMILIES,
}


def _gguf_for(spec: dict, tmp_path):
    return family_gguf(spec, tmp_path / f"{spec['arch']}.gguf")


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("shape", SHAPES)
def test_paged_logits_equal_hf(shape, tmp_path):
    hf, path = _gguf_for(SHAPES[shape], tmp_path)
    src = GGUFModel.open(path)
    model = compile_paged(build_model(src.config, src.tensor, "f16"), F32, sliding_windows=src.config.sliding_windows)
    runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=8))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf.config.vocab_size, size=90).tolist()
    ref = _hf_logits(hf, ids)

    # Prompt in two chunks over non-contiguous blocks, then decode token by token.
    # A step's logits are a view of the output tensor, valid until the next step: kept as copies.
    table = [5, 2, 7]
    got = [runner.step([ScheduledChunk(ids[:50], 0, [table[:2]], num_logits=50)]).logits[0].copy()]
    got.append(runner.step([ScheduledChunk(ids[50:80], 50, [table], num_logits=30)]).logits[0].copy())
    for pos in range(80, 90):
        got.append(runner.step([ScheduledChunk(ids[pos:pos + 1], pos, [table])]).logits[0].copy())
    np.testing.assert_allclose(np.concatenate(got), ref, atol=1e-4, rtol=0)


def test_two_sequences_in_one_step_match_separate_runs(tmp_path):
    hf, path = _gguf_for(SHAPES["llama-gqa-untied"], tmp_path)
    src = GGUFModel.open(path)
    model = compile_paged(build_model(src.config, src.tensor, "f16"), F32, sliding_windows=src.config.sliding_windows)
    runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=8))
    a, b = list(range(3, 43)), list(range(100, 170))
    out = runner.step([ScheduledChunk(a, 0, [[0, 1]], num_logits=len(a)),
                       ScheduledChunk(b, 0, [[2, 3, 4]], num_logits=0),
                       ScheduledChunk(b[:1], 0, [[6]], num_logits=1)]).logits
    np.testing.assert_allclose(out[0], _hf_logits(hf, a), atol=1e-4, rtol=0)
    assert out[1].shape == (0, hf.config.vocab_size)
    np.testing.assert_allclose(out[2], _hf_logits(hf, b[:1]), atol=1e-4, rtol=0)


def _int8_round_trip(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row asymmetric u8 with an f16 scale, written independently of the graph builder."""
    lo, hi = np.minimum(w.min(1, keepdims=True), 0), np.maximum(w.max(1, keepdims=True), 0)
    scale = (np.maximum(hi - lo, 1e-6) / 255).astype(np.float16).astype(np.float32)
    zp = np.clip(np.round(-lo / scale), 0, 255)
    return (np.clip(np.round(w / scale) + zp, 0, 255) - zp) * scale, scale


def test_int8_weights_are_compressed_and_exact(tmp_path):
    hf, path = _gguf_for(SHAPES["llama-gqa-untied"], tmp_path)
    src = GGUFModel.open(path)
    graph = build_model(src.config, src.tensor, "int8")
    u8 = [n for n in graph.get_ordered_ops() if n.get_type_name() == "Constant" and n.get_element_type().get_type_name() == "u8"]
    assert len(u8) >= 2 * 7 * src.config.num_layers  # weights and zero points of every matrix
    # The CPU plugin quantizes activations to int8 for matmuls with int8 weights where the CPU has
    # VNNI/AMX (not on AVX2), which moves logits by a CPU-dependent ~1%; with that off and f32
    # compute the graph is exactly f32 arithmetic on the dequantized weights, on every CPU.
    core = ov.Core()
    core.set_property("CPU", {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    model = compile_paged(graph, F32, core, src.config.sliding_windows)

    def round_tripped(name: str) -> GGUFTensor:
        w = src.weight(name)
        if w.ndim != 2:
            return GGUFTensor.from_array(name, w)
        q, scale = _int8_round_trip(w)
        assert (np.abs(q - w) <= scale).all()  # within a step (the f16 scale may clip an end)
        return GGUFTensor.from_array(name, q)

    ref_model = compile_paged(build_model(src.config, round_tripped, "f32"), F32,
                              sliding_windows=src.config.sliding_windows)
    ids = list(range(10, 60))
    got, ref = (ModelRunner(m, KVCache(m.layout, src.config.num_layers, num_blocks=4))
                .step([ScheduledChunk(ids, 0, [[0, 1]], num_logits=len(ids))]).logits[0]
                for m in (model, ref_model))
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # And the u8 grid stays close to the original f16 weights: most next-token choices agree with HF.
    assert (got.argmax(-1) == _hf_logits(hf, ids).argmax(-1)).mean() > 0.8


def _constant_types(graph, name: str) -> set[str]:
    return {n.get_element_type().get_type_name() for n in graph.get_ordered_ops()
            if n.get_type_name() == "Constant" and n.get_friendly_name() == name}


@pytest.mark.parametrize("tie", [True, False])
def test_a_q8_0_token_table_stays_8bit_with_its_values_exactly(tie, tmp_path):
    """A Q8_0 table (llama.cpp's usual for it) is kept as its int8 blocks in the f16 format: the
    graph computes exactly what the f32 graph of the same GGUF does, from half the bytes of f16.
    A table that is not such blocks stays f16."""
    hf = tiny_hf_model("llama", heads=4, kv_heads=2, tie=tie)
    tables = ("token_embd.weight",) if tie else ("token_embd.weight", "output.weight")
    src = GGUFModel.open(write_gguf(hf, tmp_path / "q8.gguf", q8_0=tables))
    plain = GGUFModel.open(write_gguf(hf, tmp_path / "f16.gguf"))
    assert _constant_types(build_model(plain.config, plain.tensor, "f16"), "model.embed_tokens.weight") == {"f16"}
    # As in the int8 test: the plugin's int8 activations (VNNI/AMX CPUs) off, so f32 compute is exact.
    core = ov.Core()
    core.set_property("CPU", {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    ids = list(range(10, 60))
    logits = []
    for fmt in ("f32", "f16"):
        graph = build_model(src.config, src.tensor, fmt)
        for name in ("model.embed_tokens.weight", "lm_head.weight")[:len(tables)]:
            assert _constant_types(graph, name) == ({"f32"} if fmt == "f32" else {"i8"}), (fmt, name)
        model = compile_paged(graph, F32, core, src.config.sliding_windows)
        runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=4))
        logits.append(runner.step([ScheduledChunk(ids, 0, [[0, 1]], num_logits=len(ids))]).logits[0].copy())
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-4, rtol=0)


def test_llama3_rope_scaling_matches_hf_inverse_frequencies():
    hf = tiny_hf_model("llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    ours = RopeConfig(500000.0, hf.config.head_dim, scaling=LLAMA3_SCALING).inverse_frequencies()
    np.testing.assert_allclose(ours, hf.model.rotary_emb.inv_freq.double().numpy(), rtol=1e-6)


def _fully_connected(model) -> int:
    ops_ = model.compiled.get_runtime_model().get_ordered_ops()
    return sum(op.get_rt_info()["layerType"].astype(str) == "FullyConnected" for op in ops_)


@pytest.mark.parametrize("shape,weights", [("llama-gqa-untied", "f16"), ("qwen2-qkv-bias", "f16"),
                                           ("llama-mha-tied", "int8"), ("llama-gqa-untied", "int4")])
def test_fused_qkv_projection_gives_identical_logits(shape, weights, tmp_path):
    """q/k/v merged into one MatMul (fuse_projections) compute the same dot products: logits are
    bit-identical to the unfused graph's, and only the attention projections were merged (i4
    groups too: packed 4-bit blocks merge as bytes)."""
    _, path = _gguf_for(SHAPES[shape], tmp_path)
    src = GGUFModel.open(path)
    ids = list(range(10, 60))
    models, logits = [], []
    for fuse in (False, True):
        model = compile_paged(build_model(src.config, src.tensor, weights),
                              CompileOptions(inference_precision="f32", kv_cache_precision="f32", fuse_projections=fuse))
        runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=4))
        logits.append(runner.step([ScheduledChunk(ids, 0, [[0, 1]], num_logits=len(ids))]).logits[0].copy())
        models.append(model)
    assert _fully_connected(models[0]) - _fully_connected(models[1]) == 2 * src.config.num_layers
    np.testing.assert_array_equal(logits[1], logits[0])
