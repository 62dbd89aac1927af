"""The overlapped step loop (step N+1 planned and set up while step N computes) against the
engine run one step at a time: the same tokens, logprobs and finish reasons for every request,
whatever ends it mid-flight, and every KV block back at the end."""
from __future__ import annotations

import numpy as np
import pytest
from gguf_fixtures import tiny_hf_model, write_gguf
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model("llama", heads=4, kv_heads=2)
    path = write_gguf(hf, tmp_path_factory.mktemp("overlap") / "tiny.gguf")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in (7, 40, 90, 3, 66, 25, 130, 12)]
    return str(path), prompts


def _engine(path: str, overlap: bool, num_blocks: int, prefix: bool = True) -> LLMEngine:
    cfg = EngineConfig(model=path, compile=F32, num_kv_blocks=num_blocks, overlap_steps=overlap,
                       enable_prefix_caching=prefix,
                       scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48))
    return LLMEngine(cfg, log=lambda m: None)


def _workload(engine: LLMEngine, prompts: list[list[int]], stop_text: str) -> list[SamplingParams]:
    """Requests that end every way a request can end while the next step is already planned."""
    eos = engine.eos_token_ids[0]
    return [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=11, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0.8, seed=5, stop=[stop_text] if stop_text else []),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=18, temperature=1.0, seed=9, n=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=1),
        SamplingParams(max_tokens=40, temperature=1.2, seed=2, logit_bias={eos: 6.0}),  # ends at EOS early
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3),
    ]


def _text(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> str:
    engine.add_request("probe", prompt, params)
    text = ""
    while engine.has_unfinished_requests:
        text += "".join(out.new_text for out in engine.step())
    return text


def _run(engine: LLMEngine, prompts, params, arrivals, aborts) -> dict[str, tuple]:
    results: dict[str, list] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests:
        for i, at in enumerate(arrivals):
            if at == step:
                p = params[i]
                for j in range(p.n):
                    rid = f"r{i}-{j}"
                    engine.add_request(rid, prompts[i], p.choice(j), fork_of=f"r{i}-0" if j else None)
                    results[rid] = [[], "", [], [], None]
        for rid, at in aborts.items():
            if at == step:
                results[rid][4] = engine.abort_request(rid).finish_reason
        for out in engine.step():
            r = results[out.request_id]
            r[0] += out.new_token_ids
            r[1] += out.new_text
            r[2] += [lp for lp, _ in out.new_logprobs or []]
            r[3] += [e[0] for e in out.prompt_logprobs[1:]] if out.prompt_logprobs else []
            r[4] = out.finish_reason
        step += 1
        assert step < 3000
    return {rid: (tuple(ids), text, reason, np.array(lps + prompt_lps)) for rid, (ids, text, lps, prompt_lps, reason)
            in results.items()}


@pytest.mark.parametrize("num_blocks, prefix", [(64, True), (9, True), (64, False)])
def test_overlapped_steps_equal_one_step_at_a_time(tiny, num_blocks, prefix):
    path, prompts = tiny
    alone = _engine(path, False, num_blocks, prefix)
    params = _workload(alone, prompts, _text(alone, prompts[2], _workload(alone, prompts, "")[2])[8:11])
    arrivals = (0, 0, 1, 3, 3, 6, 10, 11)
    aborts = {"r7-0": 14}
    expected = _run(alone, prompts, params, arrivals, aborts)
    overlapped = _engine(path, True, num_blocks, prefix)
    got = _run(overlapped, prompts, params, arrivals, aborts)
    assert {rid: r[:3] for rid, r in got.items()} == {rid: r[:3] for rid, r in expected.items()}
    for rid, r in got.items():  # a step's batch differs where a request ended mid-flight: kernels round differently
        np.testing.assert_allclose(r[3], expected[rid][3], rtol=1e-4, atol=1e-5)
    finishes = {r[2] for r in got.values()}
    assert {"length", "stop", "abort"} <= finishes, finishes
    if num_blocks == 9:
        assert overlapped.scheduler.num_preemptions > 0
    for engine in (alone, overlapped):
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert not engine.scheduler.running and not engine.scheduler.waiting


def test_the_next_step_is_set_up_while_one_computes(tiny):
    path, prompts = tiny
    engine = _engine(path, True, 64)
    calls = []
    for name in ("prepare", "start", "wait"):
        method = getattr(engine.runner, name)
        setattr(engine.runner, name, lambda *a, _m=method, _n=name: (calls.append(_n), _m(*a))[1])
    engine.add_request("a", prompts[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests:
        engine.step()
    # the prompt, then five decode steps each prepared before the one in flight is waited on;
    # the sixth token ends the request, so no step is planned after its last
    assert calls == ["prepare", "start"] + ["prepare", "wait", "start"] * 5 + ["wait"]
    assert engine.blocks.num_free_blocks == 64


def test_a_prompt_shares_the_blocks_of_a_step_still_computing(tiny):
    """A request planned while the step holding its prefix computes reuses those blocks: they are
    registered at launch, and the step that reads them runs after it."""
    path, prompts = tiny
    head = prompts[6][:96]  # the first prompt's start: its chunks of a block each (the budget, 48, cuts at a block's end)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = _engine(path, True, 64)
    block = engine.blocks.block_size
    engine.add_request("a", prompts[6], params)
    assert engine.step() == []  # the first chunk ran; the second is in flight
    engine.add_request("b", head + prompts[0], params)
    b = engine.scheduler.waiting[0]
    got = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert b.num_cached_prompt_tokens == 2 * block  # the chunk that ran and the one that was computing
    reference = _engine(path, False, 64, prefix=False)
    for rid, prompt in (("a", prompts[6]), ("b", head + prompts[0])):
        reference.add_request(rid, prompt, params)
    want = {}
    while reference.has_unfinished_requests:
        for out in reference.step():
            want.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert got == want
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
