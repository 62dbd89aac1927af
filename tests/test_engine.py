"""The engine against HF transformers: exact greedy tokens under chunked prefill, staggered
arrivals, preemption and aborts; every KV block back in the free list at the end."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf_fixtures import tiny_hf_model, write_gguf
from hf_reference import hf_greedy
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
PROMPT_LENS = (5, 37, 100, 150, 64, 1)
ARRIVAL_STEPS = (0, 0, 2, 5, 9, 9)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model("llama", heads=4, kv_heads=2)
    path = write_gguf(hf, tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in PROMPT_LENS]
    return hf, str(path), prompts


@pytest.fixture(scope="module")
def reference(tiny):
    hf, _, prompts = tiny
    return [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def _engine(path: str, num_blocks: int, budget: int = 64, max_seqs: int = 8) -> LLMEngine:
    cfg = EngineConfig(model=path, compile=F32, num_kv_blocks=num_blocks,
                       scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget))
    return LLMEngine(cfg, log=lambda m: None)


def _run_staggered(engine: LLMEngine, prompts, params, aborts=None) -> dict[str, list[int]]:
    """Adds prompt i at step ARRIVAL_STEPS[i]; aborts {request_id: step}; returns generated ids."""
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while step <= max(ARRIVAL_STEPS) or engine.has_unfinished_requests:
        for i, at in enumerate(ARRIVAL_STEPS):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], params)
        for rid, at in (aborts or {}).items():
            if at == step:
                assert engine.abort_request(rid).finish_reason == "abort"
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        step += 1
        assert step < 2000
    return out


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_greedy_equals_hf_with_chunked_prefill_and_staggered_arrivals(tiny, reference):
    _, path, prompts = tiny
    engine = _engine(path, num_blocks=64)
    out = _run_staggered(engine, prompts, GREEDY)
    assert [out[f"r{i}"] for i in range(len(prompts))] == reference
    assert engine.scheduler.num_preemptions == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_preemption_does_not_change_outputs(tiny, reference):
    _, path, prompts = tiny
    # 12 blocks of 32 tokens cannot hold all six sequences (about 500 tokens) at once.
    engine = _engine(path, num_blocks=12)
    out = _run_staggered(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [out[f"r{i}"] for i in range(len(prompts))] == reference
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_aborts_free_every_block(tiny, reference):
    _, path, prompts = tiny
    engine = _engine(path, num_blocks=12)
    out = _run_staggered(engine, prompts, GREEDY, aborts={"r1": 4, "r3": 6, "r5": 10})
    for i in (0, 2, 4):
        assert out[f"r{i}"] == reference[i]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_offline_llm_generate_and_limits(tiny, reference):
    _, path, prompts = tiny
    llm = LLM(EngineConfig(model=path, compile=F32, num_kv_blocks=64), log=lambda m: None)
    results = llm.generate(prompts[:3], GREEDY)
    assert [r.token_ids for r in results] == reference[:3]
    assert all(r.finish_reason == "length" for r in results)
    with pytest.raises(ValueError, match="maximum context length is 512"):
        llm.generate([[1] * 500], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    assert llm.engine.blocks.num_free_blocks == 64


def test_seeded_sampling_is_independent_of_the_batch(tiny):
    _, path, prompts = tiny
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    llm = LLM(EngineConfig(model=path, compile=F32, num_kv_blocks=64), log=lambda m: None)
    alone = llm.generate([prompts[2]], params)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    mixed = llm.generate([prompts[0], prompts[2], prompts[3]], [others, params, others])
    assert mixed[1].token_ids == alone


def test_stop_token_and_stop_string(tiny, reference):
    _, path, prompts = tiny
    llm = LLM(EngineConfig(model=path, compile=F32, num_kv_blocks=64), log=lambda m: None)
    stop_id = reference[0][5]
    first = reference[0].index(stop_id)
    r = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_id]))[0]
    assert r.token_ids == reference[0][:first + 1] and r.finish_reason == "stop"
    full = llm.generate([prompts[0]], GREEDY)[0].text
    stop = full[10:13]
    r = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert r.finish_reason == "stop" and r.text == full[:full.index(stop)]


def test_offline_n_choices_share_one_prompt_computation(tiny):
    _, path, prompts = tiny
    # no prefix cache: only forking can save the choices' prompt computations here
    llm = LLM(EngineConfig(model=path, compile=F32, num_kv_blocks=64, enable_prefix_caching=False),
              log=lambda m: None)
    choice = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = [llm.generate([prompts[1]], replace(choice, seed=7 + j))[0].token_ids for j in range(3)]
    computed = []
    prepare = llm.engine.runner.prepare

    def counting_prepare(chunks, rotation=None):
        computed.append(sum(len(c.token_ids) for c in chunks))
        return prepare(chunks, rotation)

    llm.engine.runner.prepare = counting_prepare
    results = llm.generate([prompts[1], prompts[2]], [replace(choice, n=3), GREEDY])
    assert [r.token_ids for r in results[:3]] == alone and len({tuple(t) for t in alone}) == 3
    assert len(results) == 4 and results[3].prompt_token_ids == prompts[2]
    # each prompt once, then every choice's own tokens after its first
    assert sum(computed) == len(prompts[1]) + 3 * 11 + len(prompts[2]) + MAX_TOKENS - 1
    assert llm.engine.blocks.num_free_blocks == 64
    with pytest.raises(ValueError, match="^n"):
        llm.engine.add_request("x", prompts[0], SamplingParams(n=2))
