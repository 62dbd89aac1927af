"""Cache eviction with RoPE re-rotation, end to end through the engine, against HF transformers."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from gguf_fixtures import tiny_hf_model, write_gguf
from hf_reference import hf_greedy

from vinoserve.cache.eviction import CacheEvictionConfig, EvictionState
from vinoserve.cache.key_codec import KeyCodec
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams

B = 32
EVICT = CacheEvictionConfig(start_size=32, recent_size=32, max_cache_size=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model("llama", heads=4, kv_heads=2, rope_theta=100000.0)
    return hf, str(write_gguf(hf, tmp_path_factory.mktemp("evict") / "tiny.gguf"))


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    # With one layer the kept tokens' K/V do not depend on the evicted ones, so a fresh run on the
    # survivors is the exact reference (deeper layers' K/V were computed with the full context).
    hf = tiny_hf_model("llama", heads=4, kv_heads=2, layers=1, rope_theta=100000.0)
    return hf, str(write_gguf(hf, tmp_path_factory.mktemp("evict1") / "one.gguf"))


def _engine(path, kv="f32", host=False, eviction=EVICT, blocks=32, precision="f32") -> LLMEngine:
    cfg = EngineConfig(model=path, compile=CompileOptions(inference_precision=precision, kv_cache_precision=kv),
                       num_kv_blocks=blocks, cache_eviction=eviction, host_rotation=host)
    return LLMEngine(cfg, log=lambda m: None)


def _run(engine: LLMEngine, prompt, params, check=None):
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished_requests:
        outs += engine.step()
        if check:
            check(engine)
    return outs


@pytest.mark.parametrize("kv, host, tol", [("f32", False, 1e-4), ("f32", True, 1e-4), ("f16", False, 3e-3),
                                           ("f16", True, 3e-3), ("u8", True, 0.15)])
def test_logits_after_eviction_equal_a_fresh_run_on_the_survivors(one_layer, kv, host, tol):
    hf, path = one_layer
    engine = _engine(path, kv=kv, host=host)
    assert engine.runner.model.options.cache_rotation == (not host and kv in ("f32", "f16"))
    prompt = np.random.default_rng(3).integers(0, hf.config.vocab_size, 100).tolist()
    # After the prompt (100 tokens > 64 + 32) block 1 is the only evictable block, in every layer.
    outs = _run(engine, prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=20, ignore_eos=True))
    assert engine.evictor.num_evicted_blocks == engine.model.config.num_layers
    assert engine.evictor.num_rotated_blocks == 2 * engine.model.config.num_layers
    first = outs[0].new_token_ids[0]
    survivors = prompt[:32] + prompt[64:] + [first]  # compacted positions 0..68
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([survivors])).logits[0, -1].double(), -1).numpy()
    logprob, top = outs[1].new_logprobs[0]
    if tol <= 1e-3:
        assert outs[1].new_token_ids[0] == int(ref.argmax())
    for token, lp in top:
        assert abs(lp - ref[token]) < tol, (token, lp, ref[token])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_without_rotation_keys_keep_their_phase_and_new_tokens_their_positions(tiny):
    hf, path = tiny
    engine = _engine(path, eviction=CacheEvictionConfig(32, 32, 64, rotation=False))
    prompt = list(range(3, 103))
    outs = _run(engine, prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert engine.evictor.num_evicted_blocks > 0 and engine.evictor.num_rotated_blocks == 0
    assert len(outs) == 4 and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_memory_stays_bounded_per_layer_and_returns_to_zero(tiny):
    _, path = tiny
    cfg = CacheEvictionConfig(start_size=32, recent_size=32, max_cache_size=96, aggregation="sum")
    engine = _engine(path, kv="u8", eviction=cfg, blocks=64)
    limit = cfg.max_cache_size // B + 1
    peak = [0]

    def check(eng):
        for req in eng._requests.values():
            assert all(len(t) <= limit for t in req.seq.block_tables), [len(t) for t in req.seq.block_tables]
            peak[0] = max(peak[0], len(req.seq.block_tables[0]))

    _run(engine, list(range(10, 60)), SamplingParams(max_tokens=300, temperature=0.7, seed=1, ignore_eos=True),
         check)
    assert peak[0] == limit and engine.evictor.num_evicted_blocks > 0
    assert all(a.num_free == a.num_blocks for a in engine.blocks.allocators)


def test_eviction_that_never_triggers_changes_nothing(tiny):
    hf, path = tiny
    prompts = [list(range(5, 45)), list(range(100, 190)), list(range(7, 12))]
    reference = [hf_greedy(hf, p, 20) for p in prompts]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(EngineConfig(model=path, compile=CompileOptions("CPU", "f32", "f32"), num_kv_blocks=32),
                log=lambda m: None)
    idle = LLM(EngineConfig(model=path, compile=CompileOptions("CPU", "f32", "f32"), num_kv_blocks=32,
                            cache_eviction=CacheEvictionConfig(32, 32, 512)), log=lambda m: None)
    assert [r.token_ids for r in plain.generate(prompts, params)] == reference
    assert [r.token_ids for r in idle.generate(prompts, params)] == reference
    assert idle.engine.evictor.num_evicted_blocks == 0


def test_per_request_overrides_are_validated(tiny):
    _, path = tiny
    engine = _engine(path)
    with pytest.raises(ValueError, match="multiple of the block size"):
        engine.add_request("a", [1, 2, 3], SamplingParams(), cache_eviction={"max_cache_size": 100})
    with pytest.raises(ValueError, match="unknown cache_eviction fields: bogus"):
        engine.add_request("b", [1, 2, 3], SamplingParams(), cache_eviction={"bogus": 1})
    engine.add_request("c", [1, 2, 3], SamplingParams(), cache_eviction={"enabled": False})
    plain = LLMEngine(EngineConfig(model=path, num_kv_blocks=8), log=lambda m: None)
    with pytest.raises(ValueError, match="without cache eviction"):
        plain.add_request("d", [1, 2, 3], SamplingParams(), cache_eviction={"max_cache_size": 64})


def test_policy_keeps_start_and_recent_and_drops_the_least_attended():
    state = EvictionState(CacheEvictionConfig(32, 32, 128, aggregation="sum"), num_layers=2, block_size=B)
    scores = np.ones((2, 160))
    scores[0, 64:96] = 0.01  # layer 0 ignores block 2
    scores[1, 96:128] = 0.01  # layer 1 ignores block 3
    scores[:, :32] = scores[:, 128:] = 0.0  # start and recent areas: never evicted, however ignored
    state.add(list(scores))
    assert state.plan(num_cached=159) is None  # fits: under max_cache_size + one block
    plan = state.plan(num_cached=160)  # one block too many
    assert [p.tolist() for p in plan.dropped_blocks(B)] == [[2], [3]]
    state.retain(plan)
    assert state.scores.shape == (2, 128)
    assert state.scores[0, 64:96].min() == 1.0 and state.scores[1, 64:96].max() == 1.0


def test_norm_sum_does_not_favour_old_tokens():
    cfg = CacheEvictionConfig(start_size=0, recent_size=32, max_cache_size=64, pool_window=1)
    by_norm, by_sum = EvictionState(cfg, 1, B), EvictionState(replace(cfg, aggregation="sum"), 1, B)
    for state in (by_norm, by_sum):
        # Blocks 0-1: old tokens scored 100 times at 0.5; block 2: new tokens scored 10 times at 0.9.
        state.scores = np.concatenate([np.full(64, 50.0), np.full(32, 9.0), np.zeros(32)])[None]
        state.times_scored = np.concatenate([np.full(64, 100.0), np.full(32, 10.0), np.ones(32)])[None]
    assert by_norm.plan(num_cached=128).dropped_blocks(B)[0].tolist() == [0, 1]
    assert 2 in by_sum.plan(num_cached=128).dropped_blocks(B)[0].tolist()


@pytest.mark.parametrize("kv", ["f16", "u8", "u4"])
def test_key_codecs_read_what_the_kernel_wrote(tiny, kv):
    _, path = tiny
    ref, got = [], []
    for precision, out in (("f32", ref), (kv, got)):
        engine = _engine(path, kv=precision, eviction=None, blocks=4)
        cache = KVCache(engine.model.paged.layout, engine.model.config.num_layers, 4)
        ModelRunner(engine.model.paged, cache).step([ScheduledChunk(list(range(20, 60)), 0, [[3, 1]], 1)])
        # Layer 0: deeper layers' keys already differ through the quantized attention below them.
        codec = KeyCodec.for_tensor(cache.keys[0], B, engine.model.config.head_size)
        keys = codec.read(np.array([3, 1]))
        out.append(np.concatenate([keys[0], keys[1][:, :8]], axis=1))
    err = np.abs(got[0] - ref[0]).max() / np.abs(ref[0]).max()
    assert err < {"f16": 1e-3, "u8": 1e-2, "u4": 0.1}[kv], err


@pytest.mark.slow
def test_fast_defaults_with_u8_cache_evict_and_rotate_to_completion(smollm2_gguf):
    """bf16 compute + u8 cache + eviction + rotation: the combination that aborts the reference
    pipeline. (On CPUs without bf16 the plugin computes in f32; the u8 cache and host rotation stay.)"""
    cfg = EngineConfig(compile=CompileOptions(inference_precision="bf16", kv_cache_precision="u8"),
                       num_kv_blocks=64, cache_eviction=CacheEvictionConfig(32, 64, 128))
    llm = LLM(cfg, log=lambda m: None)
    assert not llm.engine.runner.model.options.cache_rotation  # the host rotates
    tok = llm.engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a long story."}]),
                        add_special_tokens=False)
    out = llm.generate([prompt] * 3, SamplingParams(max_tokens=300, temperature=0.8, seed=3, ignore_eos=True))
    assert all(len(r.token_ids) == 300 for r in out)
    assert llm.engine.evictor.num_evicted_blocks > 0 and llm.engine.evictor.num_rotated_blocks > 0
    assert all(a.num_free == a.num_blocks for a in llm.engine.blocks.allocators)


@pytest.mark.parametrize("kv, tol, context", [("f32", 1e-4, 512), ("f32", 1e-4, 256), ("f16", 6e-3, 256),
                                               ("u8", 0.15, 256), ("u8", 0.15, 512)])
def test_token_eviction_compacts_to_a_fresh_run_on_the_survivors(tmp_path, kv, tol, context):
    """Token-granular eviction keeps scattered tokens and packs them into the first blocks. With
    room left in the context they keep their positions (new tokens too); where the next tokens
    could run past the context (256: 150 + a block + a step of 256 > 256) every key is re-rotated
    onto 0, 1, 2, ... by its own shift. Either way the next logits equal a fresh run on the
    survivors alone at those positions."""
    hf = tiny_hf_model("llama", heads=4, kv_heads=2, layers=1, rope_theta=100000.0, max_positions=context)
    path = str(write_gguf(hf, tmp_path / "one.gguf"))
    cfg = CacheEvictionConfig(32, 32, 96, snapkv_window=8, policy="tokens", protect_window=True)
    engine = _engine(path, kv=kv, eviction=cfg)
    kept = []
    compact = engine.evictor.compactor.compact
    engine.evictor.compactor.compact = lambda layer, table, keep, rotation: (kept.append(keep.copy()),
                                                                             compact(layer, table, keep, rotation))[1]
    prompt = np.random.default_rng(4).integers(0, hf.config.vocab_size, 150).tolist()
    outs = _run(engine, prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=20, ignore_eos=True))
    assert len(kept) == 1 and len(kept[0]) == 96 and engine.evictor.num_moved_tokens > 0
    keep = kept[0]
    assert keep[:32].tolist() == list(range(32)) and keep[-32:].tolist() == list(range(118, 150))
    blocks_touched = np.unique(keep[32:-32] // B)
    assert len(blocks_touched) * B > 32  # the kept middle tokens are scattered, not whole blocks
    survivors = [prompt[i] for i in keep] + [outs[0].new_token_ids[0]]
    rebased = context == 256
    positions = list(range(len(survivors))) if rebased else keep.tolist() + [len(prompt)]
    assert (engine.evictor.num_rotated_blocks > 0) == rebased
    with torch.no_grad():
        logits = hf(torch.tensor([survivors]), position_ids=torch.tensor([positions])).logits
        ref = torch.log_softmax(logits[0, -1].double(), -1).numpy()
    _, top = outs[1].new_logprobs[0]
    for token, lp in top:
        assert abs(lp - ref[token]) < tol, (token, lp, ref[token])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_the_cli_runs_the_policy_the_benchmark_chose():
    from vinoserve.bench.longctx import OURS

    assert CacheEvictionConfig.parse("32,64,672") == replace(OURS, max_cache_size=672)
    blocks = CacheEvictionConfig.parse("32,128,672", "blocks", rotation=False)
    assert blocks == CacheEvictionConfig(32, 128, 672, rotation=False)  # genai's policy, as before
