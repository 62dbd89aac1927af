"""The long-context benchmark's parts: task generation, scoring, and the forked-prefill runner,
which must generate exactly what the engine does for each eviction setting."""
from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest

from gguf_fixtures import tiny_hf_model, write_gguf

from vinoserve.bench import longctx
from vinoserve.bench.cli import add_bench_parser
from vinoserve.bench.forked_prefill import ForkedPrefill
from vinoserve.bench.longctx_tasks import TASKS, Generator, score
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.loader import resolve_model_dir
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.tokenizer import Tokenizer
from vinoserve.scheduler.sampling_params import SamplingParams

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
TOKENS = CacheEvictionConfig(32, 32, 96, snapkv_window=16, policy="tokens", protect_window=True)
SETTINGS = [None, TOKENS, replace(TOKENS, rotation=False), replace(TOKENS, policy="blocks", snapkv_window=8),
            replace(TOKENS, policy="streaming"), replace(TOKENS, aggregation="sum", pool_window=1)]


def test_score_is_the_share_of_expected_strings_found():
    assert score("The numbers are 123 and 456.", ("123", "456")) == 1.0
    assert score("the key is ABC", ("abc", "789")) == 0.5
    assert score("", ("1",)) == 0.0


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_ir_dir(resolve_model_dir(None))


def test_samples_fit_their_length_and_hold_their_answers(tokenizer):
    gen = Generator(tokenizer, "A plain sentence of an essay. Another one follows it here! " * 300, seed=0)
    for task in TASKS:
        for placement in ("last", "first"):
            s = gen.sample(task, 1024, placement, 0)
            assert s.length - 40 - s.max_tokens <= len(s.prompt_ids) <= s.length - s.max_tokens, task
            text = tokenizer.decode(list(s.prompt_ids))
            if task not in ("cwe", "fwe"):  # aggregation answers are counted, not quoted once
                assert all(a in text for a in s.answers), (task, s.answers)
        again = Generator(tokenizer, "A plain sentence of an essay. Another one follows it here! " * 300, seed=0)
        assert again.sample(task, 1024, "last", 0) == gen.sample(task, 1024, "last", 0)  # fixed seed
        assert gen.sample(task, 1024, "last", 1).prompt_ids != gen.sample(task, 1024, "last", 0).prompt_ids
    last, first = gen.sample("niah_single_2", 1024, "last", 0), gen.sample("niah_single_2", 1024, "first", 0)
    assert last.answers == first.answers
    # Question first: the prompt's end names nothing that was asked.
    tail = tokenizer.decode(list(first.prompt_ids[-40:]))
    assert "special magic" not in tail and "special magic" in tokenizer.decode(list(last.prompt_ids[-40:]))


def test_frequent_words_answers_are_the_most_frequent(tokenizer):
    s = Generator(tokenizer, "Filler text. " * 100).sample("fwe", 2048, "last", 3)
    words = tokenizer.decode(list(s.prompt_ids)).split(" .... ")
    counts = {a: sum(w.strip().endswith(a) or w.strip().startswith(a) for w in words) for a in s.answers}
    assert min(counts.values()) > 10, counts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model("llama", heads=4, kv_heads=2, layers=2, rope_theta=100000.0, max_positions=1024)
    return str(write_gguf(hf, tmp_path_factory.mktemp("longctx") / "tiny.gguf"))


def test_rows_that_evict_during_prefill_are_cached_apart():
    assert longctx.setting_name(TOKENS) == longctx.setting_name(replace(TOKENS, during_prefill=False))
    assert longctx.setting_name(replace(TOKENS, during_prefill=True)) != longctx.setting_name(TOKENS)
    rows = longctx.build_rows(["ours", "genai", "ours-prefill"], [256, 512], "")
    assert len({r.cache_name for r in rows}) == len(rows)  # every row and budget has its own replies


def test_forked_prefill_generates_what_the_engine_generates(tiny):
    prompt = np.random.default_rng(5).integers(3, 250, 400).tolist()
    engine = LLMEngine(EngineConfig(model=tiny, compile=F32, num_kv_blocks=200, cache_eviction=TOKENS),
                       log=lambda m: None)
    forked = ForkedPrefill(engine).generate(prompt, SETTINGS, max_tokens=40)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    for setting, tokens in zip(SETTINGS, forked):
        # Forks decode one token a step; verifying proposals would score other queries (and so
        # evict other blocks: docs/speculative-decoding.md, "Cache eviction").
        llm = LLM(EngineConfig(model=tiny, compile=F32, num_kv_blocks=40, cache_eviction=setting, speculative=None),
                  log=lambda m: None)
        ref = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
        assert tokens == ref, setting
        if setting is not None:
            assert llm.engine.evictor.num_evicted_blocks > 0
    assert len({tuple(t) for t in forked}) > 2  # the settings do differ


@pytest.mark.slow
def test_quick_benchmark_prints_its_table(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "longctx", "--quick", "--results", str(tmp_path)])
    longctx.main(args)
    out = capsys.readouterr().out
    assert "### 1024 tokens, question last" in out and "| vinoserve full cache |" in out
    assert "| ours |" in out and "| streaming |" in out
    assert len(list(tmp_path.rglob("*.jsonl"))) == 5  # full, and two rows at two budgets
    longctx.main(args)  # again: every reply from the cache
    assert "vinoserve 1/" not in capsys.readouterr().out
