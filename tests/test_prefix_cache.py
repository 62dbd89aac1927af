"""Prefix caching on the real engine at f32: greedy output equals the output without it, exactly,
for shared prefixes of every alignment, together, staggered and under forced preemption."""
from __future__ import annotations

import numpy as np
import pytest
from gguf_fixtures import tiny_hf_model, write_gguf
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Shared prefix length + own tokens: shorter than a block (32), exactly 2 and 3 blocks, 2 blocks + a
# few, a whole prompt equal to another one, and one that is a prefix of another.
SHAPES = ((20, 9), (64, 7), (70, 5), (96, 0), (96, 0), (64, 0), (130, 40), (70, 33))
STAGGER = (0, 3, 3, 6, 9, 12, 12, 20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model("llama", heads=4, kv_heads=2)
    path = write_gguf(hf, tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    rng = np.random.default_rng(7)
    base = rng.integers(0, hf.config.vocab_size, 200).tolist()
    prompts = [base[:n] + rng.integers(0, hf.config.vocab_size, own).tolist() for n, own in SHAPES]
    return str(path), prompts


def _engine(path: str, prefix: bool, num_blocks: int = 64, budget: int = 48) -> LLMEngine:
    cfg = EngineConfig(model=path, compile=F32, num_kv_blocks=num_blocks, enable_prefix_caching=prefix,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))
    return LLMEngine(cfg, log=lambda m: None)


def _run(engine: LLMEngine, prompts, arrivals) -> list[list[int]]:
    out = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests:
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], GREEDY)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        step += 1
        assert step < 3000
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def without_cache(tiny):
    path, prompts = tiny
    engine = _engine(path, prefix=False)
    return {"together": _run(engine, prompts, [0] * len(prompts)),
            "staggered": _run(engine, prompts, STAGGER)}


@pytest.mark.parametrize("arrivals", ["together", "staggered"])
def test_greedy_output_with_prefix_caching_equals_without(tiny, without_cache, arrivals):
    path, prompts = tiny
    engine = _engine(path, prefix=True)
    assert _run(engine, prompts, [0] * len(prompts) if arrivals == "together" else STAGGER) == without_cache[arrivals]
    prefix = engine.blocks.prefix
    assert prefix.num_hit_tokens >= 32 * 6, "the shared prefixes should have hit"
    # Run again: everything is cached now, the last token of each prompt still computed.
    assert _run(engine, prompts, STAGGER) == without_cache["staggered"]


def test_preemption_with_prefix_caching_keeps_outputs(tiny, without_cache):
    path, prompts = tiny
    engine = _engine(path, prefix=True, num_blocks=9, budget=64)
    assert _run(engine, prompts, STAGGER) == without_cache["staggered"]
    assert engine.scheduler.num_preemptions > 0


def test_follow_up_turn_hits_the_previous_turn_and_reports_cached_tokens(tiny):
    path, prompts = tiny
    engine = _engine(path, prefix=True)
    plain = _engine(path, prefix=False)
    first = _run(engine, [prompts[6]], [0])[0]
    follow_up = prompts[6] + first + prompts[0][:10]  # the history, the answer and a new turn
    engine.add_request("turn2", follow_up, GREEDY)
    outs = []
    while engine.has_unfinished_requests:
        outs += engine.step()
    assert outs[-1].num_cached_tokens == (len(prompts[6]) + len(first)) // 32 * 32
    assert [t for o in outs for t in o.new_token_ids] == _run(plain, [follow_up], [0])[0]


def test_prefix_caching_is_off_with_cache_eviction_and_refused_when_asked_for():
    ev = CacheEvictionConfig(32, 32, 512)
    assert not EngineConfig(cache_eviction=ev).prefix_caching
    assert EngineConfig().prefix_caching and not EngineConfig(enable_prefix_caching=False).prefix_caching
    with pytest.raises(ValueError, match="prefix caching and cache eviction"):
        _ = EngineConfig(cache_eviction=ev, enable_prefix_caching=True).prefix_caching


def _run_choices(engine: LLMEngine, prompt, params: list[SamplingParams], fork: bool) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        engine.add_request(f"c{i}", prompt, p, fork_of="c0" if fork and i else None)
        out[f"c{i}"] = []
    while engine.has_unfinished_requests:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [out[f"c{i}"] for i in range(len(params))]


# A partly filled last block to copy, and none; forks work without prefix caching too.
@pytest.mark.parametrize("prompt_len, prefix", [(45, True), (64, True), (45, False)])
def test_forked_choices_equal_choices_computed_alone_and_share_one_prefill(tiny, prompt_len, prefix):
    path, prompts = tiny
    prompt = prompts[6][:prompt_len]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=5 + i, ignore_eos=True) for i in range(3)]
    alone = _run_choices(_engine(path, prefix=False), prompt, params, fork=False)
    engine = _engine(path, prefix=prefix, budget=256)
    computed = []
    prepare = engine.runner.prepare

    def counting_prepare(chunks, rotation=None):
        computed.extend(len(c.token_ids) for c in chunks)
        return prepare(chunks, rotation)

    engine.runner.prepare = counting_prepare
    assert _run_choices(engine, prompt, params, fork=True) == alone
    assert len({tuple(c) for c in alone}) == 3, "seeds 5, 6, 7 should give different choices"
    assert sum(computed) == prompt_len + 3 * 9, "the prompt is computed once, then each choice decodes"


def test_aborting_the_first_choice_lets_the_others_compute_the_prompt(tiny):
    path, prompts = tiny
    engine = _engine(path, prefix=True)
    for i in range(3):
        engine.add_request(f"c{i}", prompts[6], GREEDY, fork_of="c0" if i else None)
    engine.abort_request("c0")
    engine.abort_request("c2")
    outs = []
    while engine.has_unfinished_requests:
        outs += engine.step()
    assert {o.request_id for o in outs} == {"c1"} and outs[-1].finished
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_cli_flags_and_environment(monkeypatch, capsys):
    from vinoserve.cli import _engine_config, build_parser, main

    assert _engine_config(build_parser().parse_args(["serve"])).prefix_caching
    assert not _engine_config(build_parser().parse_args(["serve", "--no-enable-prefix-caching"])).prefix_caching
    monkeypatch.setenv("VINOSERVE_ENABLE_PREFIX_CACHING", "false")
    assert not _engine_config(build_parser().parse_args(["serve"])).prefix_caching
    assert main(["serve", "--cache-eviction", "32,128,672", "--enable-prefix-caching"]) == 1
    assert "prefix caching and cache eviction" in capsys.readouterr().err
