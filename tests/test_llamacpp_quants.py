"""A K-quant file written by llama.cpp's own llama-quantize (not our encoder), kept low-bit by the
default `auto` weights and computed at f32, against transformers' f32 reading of the same file.

tests/data/llamacpp-tiny-llama-Q4_K_M.gguf (0.84 MB): a tiny Llama (hidden 256, 2 layers, the
tests' 260-token vocabulary) quantized by llama-quantize (llama.cpp 0c1e570) as Q4_K_M with ffn_up
as Q5_K: `python benchmarks/llamacpp_quants.py --quantize BIN --ci-fixture FILE` rewrites it.
llama-quantize picks its own scales, so d * sub-scale is generally not an f16: with the products
rounded to f16 (CONVERTER_VERSION 4) the logits below differ from transformers' by up to 0.34
(measured); kept in f32 they agree to f32's own level."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM

from hf_reference import hf_greedy
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model.loader import load_model
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

FIXTURE = Path(__file__).parent / "data" / "llamacpp-tiny-llama-Q4_K_M.gguf"
F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(FIXTURE.parent, gguf_file=FIXTURE.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_the_fixture_holds_every_k_quant_type_llama_quantize_chose():
    types = {t.tensor_type.name for t in GGUFReader(str(FIXTURE)).tensors if len(t.shape) == 2}
    assert types == {"Q4_K", "Q5_K", "Q6_K"}


def test_auto_logits_at_f32_equal_transformers_on_llama_quantizes_k_quants(hf):
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, 70).tolist()
    loaded = load_model(str(FIXTURE), F32, log=lambda m: None)  # weight format auto, the default
    runner = ModelRunner(loaded.paged, KVCache(loaded.paged.layout, loaded.config.num_layers, num_blocks=3))
    ours = runner.step([ScheduledChunk(ids, 0, [[0, 1, 2]], num_logits=len(ids))]).logits[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    # f32 arithmetic in another order: ~1e-5 of logits up to ~10; f16-rounded scales: 0.34.
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)


def test_auto_greedy_tokens_at_f32_equal_transformers_on_llama_quantizes_k_quants(hf):
    prompts = [np.random.default_rng(i).integers(0, hf.config.vocab_size, n).tolist()
               for i, n in enumerate((7, 40, 75))]
    engine = LLMEngine(EngineConfig(model=str(FIXTURE), compile=F32, num_kv_blocks=16,
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)),
                       log=lambda m: None)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert [out[str(i)] for i in range(len(prompts))] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
