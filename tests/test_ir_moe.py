"""Mixtures of experts from optimum-intel exports (Qwen3-MoE, Mixtral, Qwen2-MoE, gpt-oss): the
plugin gathers the export's tiled expert block (only the routed experts are read, compressed
where the export is), the startup log says so, and at f32 the engine matches transformers as the
GGUF families do (test_moe_families.py): greedy tokens with prefix hits, logprobs, speculation and
preemption. An int4 export matches optimum-intel's own runtime; a block the plugin does not
recognise is named in the log; cache eviction re-rotates their keys. Greedy tokens over staggered
prompts: test_ir_models.py."""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
import torch
from transformers import AutoModelForCausalLM

from ir_fixtures import MOE_ARCHITECTURES
from test_ir_models import F32, _assert_greedy, _prompts
from test_ir_models import _engine as _staggered_engine
from test_engine import GREEDY, _run_staggered
from test_moe_families import (assert_greedy_with_prefix_hits, assert_logprobs_equal_hfs,
                               assert_preemption_and_speculation_keep_the_tokens, staggered_case)
from vinoserve.model.paged import compile_paged

pytestmark = pytest.mark.ir
# Per layer: gate, up and down (gpt-oss: gate and up in one product, then down).
PRODUCTS = {"qwen3_moe": 6, "mixtral": 6, "qwen2_moe": 6, "gpt_oss": 4}


@pytest.fixture(scope="module")
def moe_case(ir_export):
    """arch -> (HF model, IR dir, prompts, HF's greedy tokens), built once each."""
    made = {}

    def get(arch: str):
        if arch not in made:
            export = ir_export(arch)
            hf = AutoModelForCausalLM.from_pretrained(export.hf_dir, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
            made[arch] = staggered_case(hf, export.ir_dir, seed=3)
        return made[arch]
    return get


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_plugin_gathers_the_exports_experts_and_the_log_says_so(arch, ir_export):
    paged = _staggered_engine(str(ir_export(arch).ir_dir)).model.paged
    assert paged.facts.expert_products == PRODUCTS[arch] and paged.gathered == PRODUCTS[arch]
    assert f"{PRODUCTS[arch]} expert products on the plugin's GatherMatmul" in paged.describe()


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_greedy_with_prefix_hits_equals_transformers(arch, moe_case):
    _, path, prompts, reference = moe_case(arch)
    assert_greedy_with_prefix_hits(path, prompts, reference)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_logprobs_and_prompt_logprobs_equal_transformers(arch, moe_case):
    hf, path, prompts, _ = moe_case(arch)
    assert_logprobs_equal_hfs(hf, path, prompts[2])


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_preemption_and_speculation_keep_the_tokens(arch, moe_case):
    _, path, prompts, reference = moe_case(arch)
    # with gpt-oss' sliding window one block is the null block (cache/block_manager.py)
    assert_preemption_and_speculation_keep_the_tokens(path, prompts, reference, 8 if arch == "qwen3_moe" else 10)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_int4_export_keeps_its_experts_compressed_and_equals_optimum_intels_runtime(arch, ir_export):
    """optimum-cli's int4 weights, experts included, gathered compressed by the plugin; the
    reference is the same IR run statefully by optimum-intel (SDPA, no paging)."""
    from optimum.intel import OVModelForCausalLM

    export = ir_export(f"{arch}-int4")
    ir = ov.Core().read_model(export.ir_dir / "openvino_model.xml")
    assert any(n.get_type_name() == "Constant" and n.get_element_type() == ov.Type.u4
               and len(n.get_output_shape(0)) == 4 for n in ir.get_ops()), "the experts should be int4"
    engine = _staggered_engine(str(export.ir_dir))
    assert engine.model.paged.gathered == PRODUCTS[arch]
    prompts = _prompts()
    out = _run_staggered(engine, prompts, GREEDY)
    ref = OVModelForCausalLM.from_pretrained(export.ir_dir, device="CPU", ov_config={
        "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    _assert_greedy(ref, prompts, out)


def test_an_expert_block_the_plugin_does_not_gather_is_named_in_the_log(ir_export):
    """The same block with its Tile written as a Concat (the same values): the plugin's pattern
    does not match, every token runs through every expert, and the log says so."""
    model = ov.Core().read_model(ir_export("qwen3_moe").ir_dir / "openvino_model.xml")
    for node in model.get_ordered_ops():
        if node.get_type_name() == "Tile":
            node.output(0).replace(ops.concat([node.input_value(0)] * 8, 0).output(0))
    paged = compile_paged(model, F32)
    assert paged.gathered == 0
    assert "6 of 6 expert products NOT gathered by the plugin" in paged.describe()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_eviction_rerotates_an_exports_keys(arch, ir_export, tmp_path):
    """Cache eviction on an export's mixture of experts re-rotates the kept keys (RoPE from its
    config.json); one layer, so a fresh run on the survivors is the exact reference."""
    from ir_fixtures import export_ir, save_tiny_hf
    from test_eviction import _engine as eviction_engine
    from test_eviction import _run as run_one
    from vinoserve.scheduler.sampling_params import SamplingParams

    ir_export(arch)  # skips, or fails in CI, without optimum-intel
    hf_dir = save_tiny_hf(arch, tmp_path / "hf", layers=1)
    engine = eviction_engine(str(export_ir(hf_dir, tmp_path / "ir")))
    assert engine.runner.model.options.cache_rotation
    prompt = np.random.default_rng(3).integers(0, 258, 100).tolist()
    outs = run_one(engine, prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=20, ignore_eos=True))
    assert engine.evictor.num_evicted_blocks == 1 and engine.evictor.num_rotated_blocks == 2
    survivors = prompt[:32] + prompt[64:] + [outs[0].new_token_ids[0]]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([survivors])).logits[0, -1].double(), -1).numpy()
    assert outs[1].new_token_ids[0] == int(ref.argmax())
    assert max(abs(lp - ref[token]) for token, lp in outs[1].new_logprobs[0][1]) < 1e-4
