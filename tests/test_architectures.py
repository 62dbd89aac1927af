"""The families beyond Llama's (qwen3, gemma3, phi3), from GGUFs written as llama.cpp writes them,
through the engine at f32 against HF transformers: greedy tokens equal token for token over
staggered concurrent prompts longer than any sliding window, with prefix-cache hits, n choices
on shared blocks, speculation and preemption; cache eviction refused where windows forbid it.
(Logits through PagedAttention: test_model_gguf.py, whose shapes include these families.)"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_fixtures import FAMILIES, family_gguf, tiny_hf_model, write_gguf
from hf_reference import hf_greedy
from test_engine import _run_staggered
from test_speculative import eager
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.model.architectures.phi3 import pin_longrope
from vinoserve.model.config import ModelConfig
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.paged import compile_paged
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.rope import longrope
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Prompts 3 and 5 extend prompt 1 (prefix-cache hits across a window); LongRoPE's prompts all pass
# its 64-token trained context, where HF computes with the long factors from the first token.
PROMPT_LENS = {"default": (5, 70, 100, 130, 45, 90), "phi3-longrope": (65, 70, 100, 130, 80, 90)}
WINDOWED = ("gemma3", "phi3")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (HF model, GGUF path, prompts, HF's greedy tokens for each), built once each."""
    made = {}

    def get(name: str):
        if name not in made:
            hf, path = family_gguf(FAMILIES[name], tmp_path_factory.mktemp(name) / f"{name}.gguf")
            rng = np.random.default_rng(3)
            prompts = [rng.integers(0, hf.config.vocab_size, n).tolist()
                       for n in PROMPT_LENS.get(name, PROMPT_LENS["default"])]
            prompts[3] = prompts[1] + prompts[3][len(prompts[1]):]
            prompts[5] = prompts[1][:64] + prompts[5][64:]
            made[name] = hf, str(path), prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
        return made[name]
    return get


def _engine(path: str, num_blocks: int = 64, budget: int = 48, **kwargs) -> LLMEngine:
    cfg = EngineConfig(model=path, compile=F32, num_kv_blocks=num_blocks,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), **kwargs)
    return LLMEngine(cfg, log=lambda m: None)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt, arriving at test_engine's staggered steps; every block back."""
    out = _run_staggered(engine, prompts, GREEDY)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_hf_over_staggered_prompts_longer_than_the_window(families, name):
    _, path, prompts, reference = families(name)
    engine = _engine(path)
    windows = engine.model.config.sliding_windows
    assert bool(windows) == (name in WINDOWED) and all(len(p) > max(windows, default=0) for p in prompts[1:])
    assert _run(engine, prompts) == reference
    assert engine.blocks.prefix.num_hit_tokens >= 64, "prompts 3 and 5 should start from prompt 1's blocks"


@pytest.mark.parametrize("name", WINDOWED)
def test_preemption_and_speculation_keep_tokens_with_windows(families, name):
    _, path, prompts, reference = families(name)
    # 6 blocks' memory cannot hold the six sequences at once: the newest are preempted and
    # recomputed. Gemma 3's layer groups are one layer each (1 global, 5 sliding), so its blocks
    # hold one layer, phi3's all six.
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1,
                             disable_by_batch_size=1024)
    engine = eager(_engine(path, num_blocks=36 if name == "gemma3" else 6, speculative=spec))
    assert _run(engine, prompts) == reference
    # Random weights rarely repeat themselves, so proposals are mostly rejected: verified either way.
    assert engine.scheduler.num_preemptions > 0 and engine.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("name", WINDOWED)
def test_n_choices_share_the_prompt_and_each_equals_hf(families, name):
    _, path, prompts, reference = families(name)
    llm = LLM(EngineConfig(model=path, compile=F32, num_kv_blocks=32), log=lambda m: None)
    results = llm.generate([prompts[2], prompts[3]], SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0,
                                                                   ignore_eos=True))
    assert [r.token_ids for r in results] == [reference[2], reference[2], reference[3], reference[3]]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_blocks_behind_every_layers_window_are_freed_as_a_sequence_moves_on(families):
    """Phi-3's window is on every layer: a 320-token sequence runs in 6 blocks (it spans 10),
    holding only those its next step's queries can see, and still equals HF token for token."""
    hf, path, _, _ = families("phi3")
    prompt = np.random.default_rng(5).integers(0, hf.config.vocab_size, 300).tolist()
    engine = _engine(path, num_blocks=7)  # 6 usable, and the null block released entries name
    assert engine.blocks.most_held(320, 48) == 4 < engine.blocks.blocks_for(320)
    engine.add_request("long", prompt, GREEDY)
    out, held = [], []
    while engine.has_unfinished_requests:
        for o in engine.step():
            out += o.new_token_ids
        held += [sum(b != engine.blocks.null_block for b in s.block_tables[0]) for s in engine.scheduler.running]
    assert out == hf_greedy(hf, prompt, MAX_TOKENS)
    assert max(held) <= 4 and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_gemma3s_sliding_layers_hold_their_window_while_its_global_layer_keeps_every_block(families):
    """Gemma 3 (here 5 sliding layers with a 24-token window, then a global one) gets a block
    table per layer group from one pool: a 320-token sequence spans 10 blocks, which the global
    group keeps while each sliding group holds at most the 4 its next step can see: 30 one-layer
    blocks where every layer keeping every block takes 60. Greedy tokens equal HF's."""
    hf, path, _, _ = families("gemma3")
    prompt = np.random.default_rng(5).integers(0, hf.config.vocab_size, 300).tolist()
    engine = _engine(path, num_blocks=31)  # 30, and the null block released entries name
    assert engine.groups.windows == (0, 24, 24, 24, 24, 24) and engine.groups.num_slots == 1
    assert engine.blocks.most_held(320, 48) == 10 + 5 * 4
    engine.add_request("long", prompt, GREEDY)
    out, held = [], []
    while engine.has_unfinished_requests:
        for o in engine.step():
            out += o.new_token_ids
        for s in engine.scheduler.running:
            full, *sliding = [sum(b != engine.blocks.null_block for b in t) for t in s.block_tables]
            assert full == len(s.block_tables[0]), "a global layer's block was released"
            held.append(max(sliding))
    assert out == hf_greedy(hf, prompt, MAX_TOKENS)
    assert max(held) <= 4 and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    whole = _engine(path, num_blocks=61, window_sized_caches=False)
    assert whole.groups.num_groups == 1 and whole.blocks.most_held(320, 48) == 10  # of six-layer blocks


@pytest.mark.parametrize("name", WINDOWED)
def test_cache_eviction_is_refused_where_layers_have_windows(families, name):
    path = families(name)[1]
    with pytest.raises(ValueError, match="sliding-window"):
        _engine(path, cache_eviction=CacheEvictionConfig(32, 32, 96), enable_prefix_caching=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_is_the_same_from_gguf_from_hf_config_json_and_from_our_conversion(name, tmp_path):
    """What the engine reads of an architecture (windows, RoPE per layer, head size, scale) is
    the same from the GGUF's metadata, from HF's config.json (an IR directory's) and from the
    config.json a conversion writes."""
    hf, path = family_gguf(FAMILIES[name], tmp_path / "m.gguf")
    ours = GGUFModel.open(path).config
    for other in (ModelConfig.from_hf_dict(hf.config.to_dict()), ModelConfig.from_hf_dict(ours.to_hf_dict())):
        assert (other.head_size, other.hidden_act, other.sliding_windows, other.max_context) == \
               (ours.head_size, ours.hidden_act, ours.sliding_windows, ours.max_context)
        assert other.attention_scale == pytest.approx(ours.attention_scale)
        for layer in range(ours.num_layers):
            a, b = other.rope_of(layer), ours.rope_of(layer)
            assert (a.dim, a.attention_factor) == (b.dim, pytest.approx(b.attention_factor))
            np.testing.assert_allclose(a.inverse_frequencies(), b.inverse_frequencies(), rtol=1e-6)


# Shapes HF's own GGUF reader can take back whole: it reads no RoPE scaling, partial RoPE or
# Phi-3 window, and takes Qwen3's head size and Gemma 3's attention scale from its defaults.
HF_READABLE = {
    "llama": dict(arch="llama", heads=4, kv_heads=2),
    "qwen2": dict(arch="qwen2", heads=4, kv_heads=2, tie=True),
    "qwen3": dict(arch="qwen3", heads=2, kv_heads=1, head_dim=128),
    "gemma3": dict(arch="gemma3", heads=2, kv_heads=1, head_dim=256, layers=6, tie=True, sliding_window=24),
    "phi3": dict(arch="phi3", heads=4, kv_heads=2),
}


@pytest.mark.parametrize("name", HF_READABLE)
def test_hf_reads_our_gguf_back_as_the_same_model(name, tmp_path):
    """The fixture writer checked against an independent reader: transformers' GGUF loader builds
    the same model from the file (names, permutations, norm shifts and fused tensors undone)."""
    hf, path = family_gguf(HF_READABLE[name], tmp_path / "m.gguf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    ids = torch.tensor([np.random.default_rng(0).integers(0, hf.config.vocab_size, 60).tolist()])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=0, atol=0)


def test_gemma_residual_past_f16_range_stays_finite_at_the_plugins_default_precision(tmp_path):
    """Gemma's residual stream grows past f16's 65504 (here: one layer's post-FFN norm scaled
    up). At the plugin's default compute (bf16 on AVX512-BF16/AMX CPUs, f32 elsewhere) logits
    stay finite and pick HF's f32 tokens, bf16 rounding apart."""
    spec = {k: v for k, v in FAMILIES["gemma3"].items() if k != "arch"}
    hf = tiny_hf_model("gemma3", **spec)
    with torch.no_grad():
        w = hf.model.layers[0].post_feedforward_layernorm.weight
        w.copy_((2e4 * (1 + torch.rand_like(w))).half().float())
    src = GGUFModel.open(write_gguf(hf, tmp_path / "loud.gguf", "gemma3"))
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, 60).tolist()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    assert max(h.abs().max().item() for h in out.hidden_states) > 65504
    model = compile_paged(build_model(src.config, src.tensor), CompileOptions(),
                          sliding_windows=src.config.sliding_windows)
    runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=2))
    logits = runner.step([ScheduledChunk(ids, 0, [[0, 1]], num_logits=len(ids))]).logits[0]
    assert np.isfinite(logits).all()
    assert (logits.argmax(-1) == out.logits[0].numpy().argmax(-1)).mean() >= 0.75


def test_an_exported_longrope_switch_is_pinned_to_the_factors_the_config_chose():
    """optimum-cli exports Phi-3's LongRoPE as Select(largest position + 1 > trained context,
    long, short): under PagedAttention that would follow the step's longest sequence. The pass
    pins it to the factors chosen as for a GGUF (long: served context 512 > trained 64), so
    the table no longer depends on the step (measured on a tiny optimum export: exact vs HF)."""
    short, long = [1.0, 1.1, 1.2, 1.3], [2.0, 2.5, 3.0, 3.5]
    position = ops.parameter([], ov.Type.i64, name="position")
    factors = ops.select(ops.greater(ops.add(position, ops.constant(np.int64(1))), ops.constant(np.int64(64))),
                         ops.constant(np.array(long, np.float32)), ops.constant(np.array(short, np.float32)))
    model = ov.Model([ops.result(factors)], [position])
    assert pin_longrope(model, longrope(10000.0, 8, short, long, 64, 512)) == 1
    assert "Select" not in {n.get_type_name() for n in model.get_ordered_ops()}
    compiled = ov.Core().compile_model(model, "CPU")
    for pos in (3, 300):
        np.testing.assert_array_equal(compiled({"position": np.int64(pos)})[0], np.float32(long))
