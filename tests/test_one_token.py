"""The kernel compilation's one-token clone (model/one_token.py): static shapes for steps of one
token, the same arithmetic as the dynamic compilation it is cloned from."""
from __future__ import annotations

from pathlib import Path

import pytest

from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.model_runner import ModelRunner
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.model import cpu_defaults, lowbit, one_token
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.cpu_class import CpuClass
from vinoserve.scheduler.sampling_params import SamplingParams

MODEL = str(Path(__file__).parent / "data" / "llamacpp-tiny-llama-Q4_K_M.gguf")


@pytest.fixture
def avx512_bf16(kernel, monkeypatch) -> None:
    """The CPU class whose defaults put the one compilation on the kernel, on any CPU it runs on."""
    monkeypatch.setattr(cpu_defaults, "this_cpu", lambda: CpuClass.AVX512_BF16)


def _engine(one_token: bool, speculative: SpeculativeConfig | None = None,
            eviction: CacheEvictionConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=MODEL, speculative=speculative, compile=CompileOptions(one_token=one_token),
                                  cache_eviction=eviction, num_kv_blocks=32 if eviction else None), log=lambda m: None)


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 24) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, tuple[list[int], list[float]]] = {str(i): ([], []) for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp for lp, _ in o.new_logprobs or [])
    return out


def test_one_token_steps_run_on_the_clone_with_the_same_arithmetic(avx512_bf16, monkeypatch):
    """Greedy tokens and their logprobs bit for bit those of the dynamic compilation alone, for
    one sequence (one-token steps: the clone) and for three (the main compilation throughout)."""
    engine = _engine(True)
    paged = engine.model.paged
    assert paged.decode_graph is None and paged.decode_tokens == 1 and engine.runner.fast_step_tokens == 1
    assert [i.get_partial_shape().is_static for i in paged.decode.inputs if i.get_any_name() == "input_ids"] == [True]
    assert lowbit.PLANES not in {i.get_any_name() for i in paged.decode.inputs}  # two planes, a constant
    assert "one-token clone with static shapes (+" in paged.describe()
    steps: list[tuple[int, bool]] = []  # a step's tokens, whether it ran on the clone
    prepare = ModelRunner.prepare

    def spy(self, chunks, rotation=None):
        step = prepare(self, chunks, rotation)
        if self is engine.runner:
            steps.append((sum(len(c.token_ids) for c in chunks), any(step.request is b.request for b in self._decode_inputs)))
        return step
    monkeypatch.setattr(ModelRunner, "prepare", spy)
    one, three = [list(range(40, 70))], [list(range(40 + i, 60 + 3 * i)) for i in range(3)]
    with_clone = _generate(engine, one), _generate(engine, three)
    assert all(on_clone == (tokens == 1) for tokens, on_clone in steps) and (1, True) in steps
    without = _engine(False)
    assert without.runner.fast_step_tokens is None and "clone" not in without.model.paged.describe()
    assert with_clone == (_generate(without, one), _generate(without, three))


def test_speculation_proposes_past_the_clone(avx512_bf16):
    """A one-token step's clone is no cap on proposals (as the decode model's 16 tokens are): steps
    that verify proposals run on the main compilation, and give the same tokens."""
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = _engine(True, config)
    assert engine.speculator.proposal_cap is None and engine.speculator.cost.timed_up_to == 1
    engine.speculator._budget = lambda fit, limits, rates: list(limits)  # the most each step, whatever the timings
    prompt = list(range(50, 80)) * 3
    spoken = _generate(engine, [prompt], max_tokens=40)
    assert engine.speculator.stats.num_draft_tokens > 0
    assert spoken["0"][0] == _generate(_engine(True), [prompt], max_tokens=40)["0"][0]


def test_a_graph_that_refuses_static_shapes_loads_without_the_clone(avx512_bf16, monkeypatch):
    def refuse(model):
        raise RuntimeError("Check 'x' failed: the shapes do not fit")
    monkeypatch.setattr(one_token, "graph", refuse)
    engine = _engine(True)
    assert engine.model.paged.decode is None and engine.runner.fast_step_tokens is None
    assert "(no one-token clone: Check 'x' failed: the shapes do not fit)" in engine.model.paged.describe()
    assert len(_generate(engine, [list(range(40, 60))], max_tokens=4)["0"][0]) == 4


def test_with_cache_eviction_the_clone_scores_and_rotates_as_the_main_compilation(avx512_bf16):
    """Eviction reads each step's attention scores and rotates kept keys: the clone has the same
    inputs and outputs, so a sequence that evicts as it decodes gets the same tokens."""
    eviction = CacheEvictionConfig(start_size=32, recent_size=32, max_cache_size=64)
    engine = _engine(True, eviction=eviction)
    assert engine.runner.fast_step_tokens == 1 and engine.model.paged.options.score_outputs
    prompt = [list(range(20, 170))]
    spoken = _generate(engine, prompt, max_tokens=60)
    assert engine.evictor.num_evicted_blocks > 0
    assert spoken == _generate(_engine(False, eviction=eviction), prompt, max_tokens=60)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # every block back
