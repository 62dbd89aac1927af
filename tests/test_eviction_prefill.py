"""Cache eviction during chunked prefill: a sequence's KV stays within its budget plus one chunk
whatever its prompt's length, and what survives is exactly what a fresh run on the survivors sees."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_fixtures import tiny_hf_model, write_gguf

from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

B = 32
F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    # One layer: a token's K/V depend only on itself and its position, so after any eviction a
    # fresh run on the survivors at their compacted positions is the exact reference.
    hf = tiny_hf_model("llama", heads=4, kv_heads=2, layers=1, rope_theta=100000.0)
    return hf, str(write_gguf(hf, tmp_path_factory.mktemp("evict-prefill") / "one.gguf"))


def _engine(path, eviction, blocks, chunk, host=False) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, compile=F32, num_kv_blocks=blocks, cache_eviction=eviction,
                                  host_rotation=host, scheduler=SchedulerConfig(max_num_batched_tokens=chunk)),
                     log=lambda m: None)


def _record_peak(engine: LLMEngine) -> list[int]:
    """The most blocks any layer of any sequence held while a step computed (its table as the
    step was set up: eviction after the step brings it back under the budget)."""
    peak, prepare = [0], engine.runner.prepare

    def recording(chunks, *args):
        peak[0] = max([peak[0]] + [len(t) for c in chunks for t in c.block_tables])
        return prepare(chunks, *args)
    engine.runner.prepare = recording
    return peak


def _ref_logprobs(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].double(), -1).numpy()


@pytest.mark.parametrize("host", [False, True])
def test_every_chunk_evicts_and_the_survivors_are_exact(one_layer, host):
    """Start 32, recent 32, budget 64 and 32-token chunks: after each chunk the cache holds 96
    tokens and logical block 1 is the only evictable one, so the survivors are known whatever
    the scores say: the first block and the last two chunks."""
    hf, path = one_layer
    cfg = CacheEvictionConfig(start_size=32, recent_size=32, max_cache_size=64, during_prefill=True)
    engine = _engine(path, cfg, blocks=8, chunk=32, host=host)
    prompt = np.random.default_rng(5).integers(0, hf.config.vocab_size, 160).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=10, ignore_eos=True))
    outs, peak = [], _record_peak(engine)
    while engine.has_unfinished_requests:
        outs += engine.step()
    # chunks 3, 4 and 5 each evicted a block (after the prompt, nothing more was over the budget)
    assert engine.evictor.num_evicted_blocks == 3
    assert peak[0] == (cfg.max_cache_size + 32) // B  # the budget plus one chunk
    first = outs[0].new_token_ids[0]
    for out, survivors in ((outs[0], prompt[:32] + prompt[96:]), (outs[1], prompt[:32] + prompt[128:] + [first])):
        ref = _ref_logprobs(hf, survivors)
        assert out.new_token_ids[0] == int(ref.argmax())
        for token, lp in out.new_logprobs[0][1]:
            assert abs(lp - ref[token]) < 1e-4, (token, lp, ref[token])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_prompt_far_longer_than_the_pool_runs_in_budget_plus_one_chunk(one_layer):
    """A 460-token prompt in a pool of 8 blocks (256 tokens): refused without eviction during
    prefill, run to the end with it, never holding more than the budget and one chunk."""
    hf, path = one_layer
    chunk = 64
    cfg = CacheEvictionConfig(start_size=32, recent_size=64, max_cache_size=160, during_prefill=True)
    limit = -(-(cfg.max_cache_size + B - 1 + chunk) // B)  # budget, the block being filled, one chunk
    engine = _engine(path, cfg, blocks=limit, chunk=chunk)
    prompt = np.random.default_rng(7).integers(0, hf.config.vocab_size, 460).tolist()
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    with pytest.raises(ValueError, match="needs 500 tokens of KV cache"):
        engine.add_request("after-prefill", prompt, params, cache_eviction={"during_prefill": False})
    engine.add_request("r", prompt, params)
    peak, outs = _record_peak(engine), []
    while engine.has_unfinished_requests:
        outs += engine.step()
    # chunks and budget are whole blocks here, so eviction always leaves exactly the budget
    assert peak[0] == (cfg.max_cache_size + chunk) // B <= limit and sum(len(o.new_token_ids) for o in outs) == 40
    assert engine.scheduler.num_preemptions == 0
    assert all(a.num_free == a.num_blocks for a in engine.blocks.allocators)


def test_sessions_are_admitted_only_with_room_to_reach_their_bound(one_layer):
    """Three long prompts in a pool for two bounded sessions: the third waits for one to finish
    instead of being admitted and later preempted (which would recompute its whole prompt)."""
    hf, path = one_layer
    chunk = 64
    cfg = CacheEvictionConfig(start_size=32, recent_size=64, max_cache_size=160, during_prefill=True)
    bound = -(-(cfg.max_cache_size + B - 1 + chunk) // B)
    engine = _engine(path, cfg, blocks=2 * bound + 1, chunk=chunk)
    rng = np.random.default_rng(9)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", rng.integers(0, hf.config.vocab_size, 400).tolist(), params)
    most, done = 0, 0
    while engine.has_unfinished_requests:
        done += sum(o.finished for o in engine.step())
        most = max(most, len(engine.scheduler.running))
    assert done == 3 and most == 2 and engine.scheduler.num_preemptions == 0
    assert all(a.num_free == a.num_blocks for a in engine.blocks.allocators)


def test_a_prompt_longer_than_the_models_context_runs_with_positions_inside_it(tmp_path):
    """With rotation a sequence rebases its positions before they would leave the context, so
    evicting during prefill it may be longer than the model's context (256 here): 600 prompt
    tokens and 200 more, every position the model sees below 256. Without rotation positions
    only grow: refused, as without eviction."""
    hf = tiny_hf_model("llama", heads=4, kv_heads=2, layers=2, rope_theta=100000.0, max_positions=256)
    path = str(write_gguf(hf, tmp_path / "short.gguf"))
    cfg = CacheEvictionConfig(start_size=32, recent_size=32, max_cache_size=96, during_prefill=True,
                              policy="tokens", snapkv_window=8, protect_window=True)
    engine = _engine(path, cfg, blocks=16, chunk=64)
    prompt = np.random.default_rng(8).integers(0, hf.config.vocab_size, 600).tolist()
    params = SamplingParams(max_tokens=200, temperature=0.8, seed=5, ignore_eos=True)
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        engine.add_request("kept", prompt, params, cache_eviction={"rotation": False})
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        engine.add_request("after", prompt, params, cache_eviction={"during_prefill": False})
    ends, prepare = [], engine.runner.prepare

    def recording(chunks, *args):
        ends.extend((c.past_len if c.first_position is None else c.first_position) + len(c.token_ids)
                    for c in chunks)
        return prepare(chunks, *args)
    engine.runner.prepare = recording
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished_requests:
        outs += engine.step()
    assert sum(len(o.new_token_ids) for o in outs) == 200 and outs[-1].finished
    assert len(ends) > 200 and max(ends) <= 256  # the last position a chunk took is 255
    assert engine.evictor.num_rotated_blocks > 0
    assert all(a.num_free == a.num_blocks for a in engine.blocks.allocators)
