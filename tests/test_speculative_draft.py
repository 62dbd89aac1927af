"""Speculative decoding with a draft model: the draft's proposals change how many tokens a step
yields, never which. A model drafting for itself at f32 has every proposal accepted; SmolLM2 with
int8 weights drafting for SmolLM2 at f32 gives the plain engine's greedy tokens; a draft with
another tokenizer is refused. Both caches give every block back."""
from __future__ import annotations

from dataclasses import replace

import gguf_fixtures
import pytest

from test_engine import GREEDY, PROMPT_LENS, _run_staggered, reference, tiny  # noqa: F401
from test_speculative import eager
from vinoserve.engine.draft_proposer import DraftModelProposer
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.model.default_model import DEFAULT_MODEL
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")


def _draft_config(model: str, weight_format: str = "f32", k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=model, weight_format=weight_format,
                             num_speculative_tokens=k, disable_by_batch_size=1024)


def _self_drafting(path: str, num_blocks: int, budget: int) -> LLMEngine:
    cfg = EngineConfig(model=path, compile=F32, weight_format="f32", num_kv_blocks=num_blocks,
                       speculative=_draft_config(path),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))
    return eager(LLMEngine(cfg, log=lambda m: None))


def _all_blocks_back(engine: LLMEngine) -> None:
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    draft = engine.speculator.proposer
    assert draft.num_used_blocks > 0  # the finished sequences' draft KV waits for the next call ...
    draft.drop_finished()
    assert draft.num_used_blocks == 0  # ... which frees it


def test_self_drafting_accepts_every_proposal_under_chunking_and_staggered_arrivals(tiny, reference):
    engine = _self_drafting(tiny[1], num_blocks=64, budget=64)
    assert isinstance(engine.speculator.proposer, DraftModelProposer)
    out = _run_staggered(engine, tiny[2], GREEDY)
    assert [out[f"r{i}"] for i in range(len(PROMPT_LENS))] == reference
    s = engine.speculator.stats
    assert s.num_draft_tokens > 50 and s.num_accepted_tokens == s.num_draft_tokens
    # Fewer steps than tokens: each verifying step yielded the proposals and one more.
    assert engine.stats.num_generated_tokens > 2 * s.num_drafts
    _all_blocks_back(engine)


def test_self_drafting_through_preemption_and_aborts(tiny, reference):
    # 8 blocks of 32 tokens cannot hold every sequence: the newest are preempted and recomputed
    # (sequences finish fast while every proposal is accepted, so it takes a small cache).
    engine = _self_drafting(tiny[1], num_blocks=8, budget=48)
    out = _run_staggered(engine, tiny[2], GREEDY, aborts={"r1": 3, "r4": 14})
    assert engine.scheduler.num_preemptions > 0
    for i, ref in enumerate(reference):
        if i in (1, 4):  # aborted mid-run
            assert len(out[f"r{i}"]) < len(ref) and ref[:len(out[f"r{i}"])] == out[f"r{i}"]
        else:
            assert out[f"r{i}"] == ref
    s = engine.speculator.stats
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
    _all_blocks_back(engine)


def test_seeded_sampling_draws_the_same_tokens_as_without_speculation(tiny):
    params = [SamplingParams(max_tokens=32, temperature=t, top_p=p, seed=seed, ignore_eos=True)
              for t, p, seed in [(0.7, 1.0, 1), (1.0, 0.9, 2), (0.3, 1.0, 3)]]
    prompts = [tiny[2][i] for i in (0, 2, 4)]
    plain = LLM(EngineConfig(model=tiny[1], compile=F32, weight_format="f32", num_kv_blocks=64), log=lambda m: None)
    spec = LLM(EngineConfig(model=tiny[1], compile=F32, weight_format="f32", num_kv_blocks=64,
                            speculative=_draft_config(tiny[1])), log=lambda m: None)
    eager(spec.engine)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    s = spec.engine.speculator.stats
    assert s.num_draft_tokens > s.num_accepted_tokens > 0  # greedy proposals, sampled tokens: both outcomes


def test_a_full_draft_cache_skips_proposing_but_never_fails(tiny, reference):
    roomy = _self_drafting(tiny[1], num_blocks=64, budget=64)
    _run_staggered(roomy, tiny[2], GREEDY)
    engine = _self_drafting(tiny[1], num_blocks=64, budget=64)
    draft = engine.speculator.proposer
    # Room for one 150-token sequence and its proposals at most: the others decode plainly.
    draft.blocks = type(draft.blocks)(6, draft.blocks.block_size)
    out = _run_staggered(engine, tiny[2], GREEDY)
    assert [out[f"r{i}"] for i in range(len(PROMPT_LENS))] == reference
    assert 0 < engine.speculator.stats.num_drafts < roomy.speculator.stats.num_drafts
    _all_blocks_back(engine)


def test_a_draft_with_another_tokenizer_is_refused(tiny, tmp_path):
    hf = tiny[0]
    swapped = list(gguf_fixtures.TOKENS)
    swapped[65], swapped[66] = swapped[66], swapped[65]  # same size, two tokens trade ids
    vocab = replace(gguf_fixtures.TINY_VOCAB, tokens=swapped)
    other = gguf_fixtures.write_gguf(hf, tmp_path / "swapped.gguf", vocab=vocab)
    cfg = EngineConfig(model=tiny[1], compile=F32, weight_format="f32", num_kv_blocks=16,
                       speculative=_draft_config(str(other)))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLMEngine(cfg, log=lambda m: None)


COPY = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! The five boxing wizards jump quickly.")


@pytest.mark.slow
def test_smollm2_int8_drafting_for_f32_keeps_greedy_output(smollm2_gguf, tiny):
    def make(spec):
        llm = LLM(EngineConfig(compile=F32, weight_format="f32", kv_cache_size_gb=0.1, speculative=spec),
                  log=lambda m: None)
        eager(llm.engine)
        return llm
    plain, spec = make(None), make(_draft_config(DEFAULT_MODEL.name, "int8", k=4))
    tok = plain.engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly: {COPY}"}]),
                          add_special_tokens=False),
               tok.encode("Once upon a time, in a land far away,", add_special_tokens=False)]
    params = [SamplingParams(max_tokens=48, temperature=0), SamplingParams(max_tokens=32, temperature=0)]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    s = spec.engine.speculator.stats
    assert 0 < s.num_accepted_tokens <= s.num_draft_tokens
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks
    # Another vocabulary altogether: the tiny model cannot draft for SmolLM2.
    tiny_model = LLMEngine(EngineConfig(model=tiny[1], compile=F32, num_kv_blocks=4), log=lambda m: None).model
    with pytest.raises(ValueError, match=f"vocabularies of {len(gguf_fixtures.TOKENS)} and 49152"):
        DraftModelProposer(tiny_model, plain.engine.model, plain.engine.eos_token_ids, 1024, 64)
