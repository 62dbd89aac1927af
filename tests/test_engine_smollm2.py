"""The engine on the real SmolLM2 at f32: exact greedy tokens against HF transformers and against
openvino-genai's C++ ContinuousBatchingPipeline on the same converted model."""
from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from hf_reference import hf_greedy
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

pytestmark = pytest.mark.slow
F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea, in four lines.",
             "List three prime numbers.",
             "Explain, in two sentences, why the sky is blue and why sunsets are red and orange."]
NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    # A 32-token budget chunks every prompt over several steps while others decode.
    cfg = EngineConfig(compile=F32, weight_format="f32", num_kv_blocks=32,
                       scheduler=SchedulerConfig(max_num_batched_tokens=32))
    return LLM(cfg, log=lambda m: None)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def ours(llm, prompts):
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    return [r.token_ids for r in results]


def test_greedy_tokens_equal_hf(smollm2_hf, prompts, ours):
    assert [hf_greedy(smollm2_hf, p, NEW_TOKENS) for p in prompts] == ours


def test_greedy_tokens_equal_openvino_genai(llm, prompts, ours):
    genai = pytest.importorskip("openvino_genai")
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = 1
    scheduler.max_num_batched_tokens = 32
    pipe = genai.ContinuousBatchingPipeline(str(llm.engine.model.path), scheduler, "CPU",
                                            {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"})
    cfg = genai.GenerationConfig()
    cfg.max_new_tokens, cfg.ignore_eos, cfg.do_sample = NEW_TOKENS, True, False
    results = pipe.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts], [cfg] * len(prompts))
    assert [list(r.m_generation_ids[0]) for r in results] == ours
