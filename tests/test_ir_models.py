"""optimum-intel exports served with no list of architectures: what the engine needs comes from the
PagedAttention graph (layers, KV heads, head size, windows, vocabulary) and config.json, and at f32
greedy tokens equal transformers' over staggered concurrent prompts longer than every window."""
from __future__ import annotations

import json
import shutil

import numpy as np
import openvino as ov
import pytest
import torch
from transformers import AutoModelForCausalLM

from ir_fixtures import ARCHITECTURES, WINDOW
from test_engine import GREEDY, PROMPT_LENS, _run_staggered
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.loader import load_model
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.rope import RopeConfig
from vinoserve.scheduler.scheduler import SchedulerConfig

pytestmark = pytest.mark.ir
F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
WINDOWS = {"qwen2": (0, WINDOW), "gemma3_text": (WINDOW, 0), "mistral": (WINDOW, WINDOW), "gpt_oss": (WINDOW, 0)}


def _engine(model: str, **kwargs) -> LLMEngine:
    # A small step budget splits prompts into chunks that share steps with other sequences' decodes.
    return LLMEngine(EngineConfig(model=model, compile=F32, num_kv_blocks=64,
                                  scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48), **kwargs),
                     log=lambda m: None)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 258, n).tolist() for n in PROMPT_LENS]


def _assert_greedy(reference, prompts: list[list[int]], out: dict[str, list[int]]) -> None:
    """Teacher-forced over our tokens, the reference's argmax at every step is our token: the same
    as its own greedy run, in one forward pass per prompt."""
    for i, prompt in enumerate(prompts):
        ids = prompt + out[f"r{i}"]
        with torch.no_grad():
            logits = reference(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
        assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == out[f"r{i}"], f"prompt {i}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_equals_transformers(arch, ir_export):
    export = ir_export(arch)
    engine = _engine(str(export.ir_dir))
    spec = engine.model.config
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.vocab_size) == (2, 2, 16, 260)
    assert spec.sliding_windows == WINDOWS.get(arch, ())
    prompts = _prompts()
    out = _run_staggered(engine, prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(export.hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    _assert_greedy(hf, prompts, out)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_int4_export_equals_optimum_intels_own_runtime(ir_export):
    """int4 weights as the export holds them; the reference is the same IR run statefully by
    optimum-intel (SDPA, no paging)."""
    from optimum.intel import OVModelForCausalLM

    export = ir_export("llama-int4")
    ir = ov.Core().read_model(export.ir_dir / "openvino_model.xml")
    assert any(n.get_type_name() == "Constant" and n.get_element_type() == ov.Type.u4 for n in ir.get_ops())
    prompts = _prompts()
    out = _run_staggered(_engine(str(export.ir_dir)), prompts, GREEDY)
    ref = OVModelForCausalLM.from_pretrained(export.ir_dir, device="CPU", ov_config={
        "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    _assert_greedy(ref, prompts, out)


def test_rope_from_config_json_for_rotation(ir_export):
    assert load_model(str(ir_export("llama").ir_dir), F32).config.rotation_rope() == RopeConfig(10000.0, 16)
    phi3 = load_model(str(ir_export("phi3").ir_dir), F32).config
    assert phi3.rope == RopeConfig(10000.0, 12)
    with pytest.raises(ValueError, match="RoPE turns 12 of 16 channels"):
        phi3.rotation_rope()


def test_eviction_with_rotation_is_refused_where_the_rope_is_not_known(ir_export):
    model = str(ir_export("phi3").ir_dir)
    with pytest.raises(ValueError, match="RoPE, which is not known here: RoPE turns 12 of 16 channels .partial"):
        _engine(model, cache_eviction=CacheEvictionConfig(32, 32, 96))
    engine = _engine(model, cache_eviction=CacheEvictionConfig(32, 32, 96, rotation=False))
    with pytest.raises(ValueError, match="--no-rotation"):
        engine.add_request("r", [1, 2, 3], GREEDY, cache_eviction={"rotation": True})
    engine.add_request("r", list(range(150)), GREEDY)
    while engine.has_unfinished_requests:
        engine.step()
    assert engine.evictor.num_evicted_blocks > 0


def test_eviction_is_refused_with_sliding_windows(ir_export):
    with pytest.raises(ValueError, match="sliding-window attention models .gemma3_text."):
        _engine(str(ir_export("gemma3_text").ir_dir), cache_eviction=CacheEvictionConfig(32, 32, 96, rotation=False))


def test_windows_config_json_names_are_applied_where_the_transformation_found_none(ir_export, tmp_path):
    """The transformation finds windows only in the mask patterns it knows; config.json's
    layer_types and sliding_window are what the kernel is given."""
    model = shutil.copytree(ir_export("llama").ir_dir, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config.update(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    (model / "config.json").write_text(json.dumps(config))
    assert load_model(str(model), F32).config.sliding_windows == (WINDOW, 0)
