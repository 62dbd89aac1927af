"""Speculative decoding (prompt lookup) changes how many tokens a step yields, never which: greedy
tokens equal HF transformers' and the plain engine's, seeded sampling draws the same tokens, and
unseeded sampling the same distribution; stop strings and max_tokens that land inside an accepted
run, preemption and aborts mid-speculation; every KV block back at the end."""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from test_engine import ARRIVAL_STEPS, GREEDY, PROMPT_LENS, _run_staggered, reference, tiny  # noqa: F401
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig
from vinoserve.scheduler.sequence import Sequence

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
# min 1: random prompts repeat single tokens often, so most steps verify something.
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                          disable_by_batch_size=1024)


def eager(engine: LLMEngine) -> LLMEngine:
    """Propose the most every step, so which tokens a step verifies does not depend on this
    machine's timings."""
    if engine.speculator is not None:
        engine.speculator._budget = lambda fit, limits, rates: [max(k, 0) for k in limits]
    return engine


def _llm(config: EngineConfig) -> LLM:
    llm = LLM(config, log=lambda m: None)
    eager(llm.engine)
    return llm


def _tiny_engine(path: str, num_blocks: int, spec: SpeculativeConfig | None = NGRAM, budget: int = 64,
                 log=lambda m: None) -> LLMEngine:
    cfg = EngineConfig(model=path, compile=F32, num_kv_blocks=num_blocks, speculative=spec,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))
    return eager(LLMEngine(cfg, log=log))


def _spent(engine: LLMEngine) -> tuple[int, int]:
    s = engine.speculator.stats
    return s.num_draft_tokens, s.num_accepted_tokens


def test_greedy_equals_hf_under_chunking_and_staggered_arrivals(tiny, reference):
    engine = _tiny_engine(tiny[1], num_blocks=64)
    out = _run_staggered(engine, tiny[2], GREEDY)
    assert [out[f"r{i}"] for i in range(len(PROMPT_LENS))] == reference
    proposed, accepted = _spent(engine)
    assert proposed > accepted > 0  # it speculated, and both outcomes happened
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_only_decoding_steps_price_proposals(tiny):
    """The step-cost line is fitted to steps where every sequence decodes (its last token plus
    proposals): prompt chunks, far bigger, would steer its slope and intercept."""
    engine = _tiny_engine(tiny[1], num_blocks=64)
    _run_staggered(engine, tiny[2], GREEDY)
    sizes = set(engine.speculator.cost._seconds)
    assert len(sizes) >= 3 and max(sizes) <= 8 * (1 + NGRAM.num_speculative_tokens), sizes
    assert max(PROMPT_LENS) > 8 * (1 + NGRAM.num_speculative_tokens)  # so a prompt step would show


def test_every_start_prices_proposals_by_the_step_costs_kept_for_the_machine(tiny, tmp_path, monkeypatch):
    """The first engine measures its step costs before any request and keeps them; a later start
    measures too but prices by the kept ones, so the same request takes the same steps on every
    start; kept figures a later start beats clearly (taken under load) give way to its own."""
    monkeypatch.setenv("VINOSERVE_CACHE", str(tmp_path))

    def start() -> tuple[LLMEngine, list[str]]:
        logged: list[str] = []
        return _tiny_engine(tiny[1], num_blocks=64, log=logged.append), logged

    first, logged = start()
    measured = first.speculator.cost.figures()
    assert first.speculator.cost.frozen and first.stats.num_steps == 0 and first.speculator.stats.num_drafts == 0
    assert "step costs measured" in logged[-1] and len(measured["seconds"]) >= 3
    path = next((tmp_path / "step-costs").glob("*.json"))
    first_kept = json.loads(path.read_text())

    def keep(scale: float) -> dict:  # a tiny model's steps take under a millisecond: what a start
        # measures moves by a third with the machine, so the kept figures are set well clear of it
        path.write_text(json.dumps({**first_kept, "seconds": {n: scale * s for n, s in first_kept["seconds"].items()}}))
        kept = json.loads(path.read_text())
        return {**kept, "seconds": {int(n): s for n, s in kept["seconds"].items()},
                "overlapped": {int(n): s for n, s in kept["overlapped"].items()}}

    kept = {k: v for k, v in keep(0.5).items() if k != "measured"}
    second, logged = start()
    assert second.speculator.cost.figures() == kept and "as measured on this machine before" in logged[-1]
    keep(3.0)  # taken under load: a start that measures clearly faster steps keeps its own
    third, logged = start()
    assert "step costs measured" in logged[-1] and third.speculator.cost.figures() != kept


def test_preemption_and_aborts_mid_speculation(tiny, reference):
    # 14 blocks of 32 tokens cannot hold every sequence: the newest are preempted and recomputed.
    engine = _tiny_engine(tiny[1], num_blocks=14, budget=48)
    out = _run_staggered(engine, tiny[2], GREEDY, aborts={"r1": 12, "r4": 15})
    assert engine.scheduler.num_preemptions > 0
    for i, ref in enumerate(reference):
        if i in (1, 4):
            assert ref[:len(out[f"r{i}"])] == out[f"r{i}"]
        else:
            assert out[f"r{i}"] == ref
    assert _spent(engine)[1] > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_seeded_sampling_draws_the_same_tokens_as_without_speculation(tiny):
    params = [SamplingParams(max_tokens=40, temperature=t, top_p=p, top_k=k, seed=s, repetition_penalty=r,
                             logprobs=2, ignore_eos=True)
              for t, p, k, s, r in [(0.7, 1.0, 0, 1, 1.0), (1.0, 0.9, 0, 2, 1.1), (0.5, 1.0, 20, 3, 1.0),
                                    (0.2, 0.95, 0, 4, 1.0)]]
    prompts = [tiny[2][i] for i in (0, 1, 2, 4)]
    plain = LLM(EngineConfig(model=tiny[1], compile=F32, num_kv_blocks=64), log=lambda m: None).generate(prompts, params)
    llm = _llm(EngineConfig(model=tiny[1], compile=F32, num_kv_blocks=64, speculative=NGRAM))
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for a, b in zip(spec, plain):  # the logprobs of accepted tokens come from their own rows
        np.testing.assert_allclose([lp for lp, _ in a.logprobs], [lp for lp, _ in b.logprobs], rtol=1e-4, atol=1e-4)
    assert _spent(llm.engine)[0] > 0  # a random model rarely agrees: this is the rejection path


def _chi2_critical(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty: the chi-square quantile at normal quantile z (3.72: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    def make(spec):
        return _llm(EngineConfig(compile=F32, weight_format="f32", kv_cache_size_gb=0.2, speculative=spec))
    return make(None), make(SpeculativeConfig(disable_by_batch_size=16))


COPY = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! The five boxing wizards jump quickly.")


def _steps(engine: LLMEngine, prompts: list[list[int]], runs: list[SamplingParams]) -> list[list[list[int]]]:
    """Each request's tokens, grouped by the step that produced them."""
    for i, (prompt, params) in enumerate(zip(prompts, runs)):
        engine.add_request(f"s{i}", prompt, params)
    got: dict[str, list] = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            got[o.request_id].append(o.new_token_ids)
    return list(got.values())


def _stop_inside_a_run(tok, steps: list[list[int]]) -> str:
    """A word first completed by a token that is not the first of its step."""
    flat = sum(steps, [])
    i = 0
    for group in steps:
        for m in range(1, len(group)):
            before, after = tok.decode(flat[:i + m]), tok.decode(flat[:i + m + 1])
            word = after[len(before):].strip()
            if len(word) >= 3 and word not in before:
                return word
        i += len(group)
    raise AssertionError("no multi-token step")


@pytest.mark.slow
def test_stops_and_max_tokens_inside_accepted_runs_on_smollm2(smollm2):
    plain, spec = smollm2
    tok = plain.engine.tokenizer
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{verb} this text exactly: {COPY}"}]),
                       add_special_tokens=False) for verb in ("Repeat", "Copy")]
    chat.append(tok.encode("Once upon a time, in a land far away,", add_special_tokens=False))
    runs = [SamplingParams(max_tokens=60, temperature=0)] * 3
    steps = _steps(spec.engine, chat, runs)
    assert [sum(s, []) for s in steps] == [o.token_ids for o in plain.generate(chat, runs)]
    # max_tokens and a stop string that end the copies inside an accepted run
    ends = np.cumsum([len(g) for g in steps[0]])
    runs[0] = replace(runs[0], max_tokens=int(next(e - 1 for e, g in zip(ends, steps[0]) if len(g) > 2)))
    runs[1] = replace(runs[1], stop=[_stop_inside_a_run(tok, steps[1])])
    expected = plain.generate(chat, runs)
    engine = spec.engine
    for i, (prompt, params) in enumerate(zip(chat, runs)):
        engine.add_request(f"s{i}", prompt, params)
    got: dict[str, list] = {f"s{i}": [] for i in range(3)}
    text = {f"s{i}": "" for i in range(3)}
    while engine.has_unfinished_requests:
        for o in engine.step():
            got[o.request_id].append(o.new_token_ids)
            text[o.request_id] += o.new_text
    for i, e in enumerate(expected):
        assert sum(got[f"s{i}"], []) == e.token_ids
        assert text[f"s{i}"] == e.text
    assert expected[0].finish_reason == "length" and expected[1].finish_reason == "stop"
    assert len(got["s0"][-1]) > 1 and len(got["s1"][-1]) > 1  # both ended on a multi-token step
    # The first step of each copied run is planned ahead of its last token, without proposals
    # (Speculator.plan_ahead): fewer accepted than if every step waited to propose.
    assert engine.speculator.stats.num_accepted_tokens > 10
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.slow
def test_seeded_sampling_on_smollm2_accepts_and_draws_the_same_tokens(smollm2):
    plain, spec = smollm2
    tok = plain.engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly: {COPY}"}]),
                        add_special_tokens=False)
    params = [SamplingParams(max_tokens=48, temperature=t, top_p=p, seed=s, logprobs=1)
              for t, p, s in [(0.7, 1.0, 11), (1.0, 0.9, 12), (0.3, 1.0, 13)]]
    before = spec.engine.speculator.stats.num_accepted_tokens
    got = spec.generate([prompt] * 3, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate([prompt] * 3, params)]
    assert spec.engine.speculator.stats.num_accepted_tokens - before > 10


@pytest.mark.slow
def test_unseeded_sampling_keeps_the_distribution(smollm2):
    """Two-sample chi-square over the first four tokens of 600 unseeded choices of a copying
    prompt at temperature 1, with and without speculation: proposals are made at every step and
    both accepted and rejected, so both halves of the rule are exercised. The choices fork one
    prefill and run in one batch (600 separate requests took 41 s an engine, most of it prompts)."""
    n = 600
    tok = smollm2[0].engine.tokenizer
    # The reply already under way, so the model copies from its first token on.
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly: {COPY}"}])
                        + "The quick", add_special_tokens=False)
    # ignore_eos: at temperature 1 a sample may end early, and outcomes must all be four tokens long
    params = SamplingParams(n=n, max_tokens=4, temperature=1.0, ignore_eos=True)

    def samples(spec: SpeculativeConfig | None) -> tuple[Counter, LLMEngine]:
        cfg = EngineConfig(compile=F32, weight_format="f32", kv_cache_size_gb=1.0, speculative=spec,
                           scheduler=SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=4096))
        llm = _llm(cfg)
        return Counter(tuple(o.token_ids) for o in llm.generate([prompt], params)), llm.engine

    with_spec, engine = samples(NGRAM)
    without, _ = samples(None)
    stats = engine.speculator.stats
    assert stats.num_drafts > 0.8 * n and n < stats.num_accepted_tokens < stats.num_draft_tokens - 20, stats
    # The whole 4-token outcome, and each verified position's token on its own.
    tested = 0
    for key in (lambda t: t, lambda t: t[1], lambda t: t[2], lambda t: t[3]):
        tested += _two_sample_chi2(_regroup(with_spec, key), _regroup(without, key), n)
    assert tested >= 4


def _regroup(outcomes: Counter, key) -> Counter:
    grouped: Counter = Counter()
    for outcome, count in outcomes.items():
        grouped[key(outcome)] += count
    return grouped


def _two_sample_chi2(a_counts: Counter, b_counts: Counter, n: int) -> int:
    """Asserts both samples (n each) come from one distribution; returns the cells compared.
    Outcomes seen fewer than 10 times in both together are pooled into one cell."""
    cells = [k for k in a_counts.keys() | b_counts.keys() if a_counts[k] + b_counts[k] >= 10]
    a = [a_counts[k] for k in cells] + [n - sum(a_counts[k] for k in cells)]
    b = [b_counts[k] for k in cells] + [n - sum(b_counts[k] for k in cells)]
    pairs = [(x, y) for x, y in zip(a, b) if x + y]
    if len(pairs) < 2:
        return 0
    stat = sum((x - y) ** 2 / (x + y) for x, y in pairs)
    assert stat < _chi2_critical(len(pairs) - 1), (stat, a, b)
    return len(pairs)


@pytest.mark.slow
def test_blocks_filled_by_accepted_proposals_serve_later_prefix_hits(smollm2):
    """A follow-up turn whose prompt is the first turn's prompt and reply hits the blocks that
    verification filled, and still answers exactly as the plain engine does."""
    plain, spec = smollm2
    tok = plain.engine.tokenizer
    first = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly: {COPY}"}]),
                       add_special_tokens=False)
    greedy = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    reply = spec.generate([first], greedy)[0].token_ids
    assert reply == plain.generate([first], greedy)[0].token_ids
    follow = first + reply + tok.encode("\nAgain:", add_special_tokens=False)
    engine = spec.engine
    engine.add_request("turn2", follow, greedy)
    got, cached = [], 0
    while engine.has_unfinished_requests:
        for o in engine.step():
            got += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached >= (len(first) + len(reply)) // 32 * 32 - 32  # the reply's full blocks were hits
    assert got == plain.generate([follow], greedy)[0].token_ids


@pytest.mark.parametrize("rotation", [True, False])
def test_with_cache_eviction_evictions_come_at_the_same_token_counts(tiny, rotation):
    """Proposals never cross an eviction point, so a speculating sequence evicts exactly where a
    plain one does; until the first eviction its tokens are the plain ones; blocks all return."""
    from vinoserve.cache.eviction import CacheEvictionConfig

    evict = CacheEvictionConfig(start_size=32, recent_size=32, max_cache_size=96, rotation=rotation)
    prompt = tiny[2][2][:40]
    params = SamplingParams(max_tokens=260, temperature=0, ignore_eos=True)

    def run(spec):
        engine = eager(LLMEngine(EngineConfig(model=tiny[1], compile=F32, num_kv_blocks=32, cache_eviction=evict,
                                              speculative=spec), log=lambda m: None))
        engine.add_request("r", prompt, params)
        tokens, evictions, seen = [], [], 0
        while engine.has_unfinished_requests:
            for o in engine.step():
                tokens += o.new_token_ids
            if engine.evictor.num_evicted_blocks > seen:
                evictions.append((len(tokens), engine.evictor.num_evicted_blocks - seen))
                seen = engine.evictor.num_evicted_blocks
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        return tokens, evictions, engine

    plain, plain_evictions, _ = run(None)
    spec, spec_evictions, engine = run(NGRAM)
    assert len(plain_evictions) >= 3 and spec_evictions == plain_evictions
    first = plain_evictions[0][0]
    assert spec[:first] == plain[:first]
    assert _spent(engine)[1] > 0


def test_proposals_count_against_the_token_budget_and_never_preempt():
    from vinoserve.cache.block_manager import BlockManager
    from vinoserve.scheduler.scheduler import Scheduler
    
    def decoding(sched: Scheduler, rid: str) -> Sequence:
        """A sequence whose 31-token prompt is computed and whose first token was sampled."""
        seq = Sequence(rid, list(range(31)), SamplingParams(max_tokens=50))
        sched.add(seq)
        sched.schedule()
        seq.num_computed_tokens = 31
        seq.output_token_ids.append(5)
        seq.draft_token_ids = [1, 2, 3, 4]
        return seq

    blocks = BlockManager(num_blocks=4, block_size=32)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=40), blocks)
    a = decoding(sched, "a")
    b = Sequence("b", list(range(36)), SamplingParams(max_tokens=5))  # whole in 40 tokens, not in 35
    sched.add(b)
    plan = sched.schedule()
    assert [(s.num_tokens, s.num_drafts) for s in plan.scheduled] == [(5, 4), (35, 0)]  # 40 in all
    assert len(a.block_tables[0]) == 2  # the proposals reach into a second block
    sched.rollback(a)  # none accepted: the block that held only proposals goes back
    assert len(a.block_tables[0]) == 1 and blocks.num_free_blocks == 4 - 1 - 2

    small = Scheduler(SchedulerConfig(max_num_batched_tokens=3), BlockManager(num_blocks=4, block_size=32))
    c = decoding(small, "c")
    assert [(s.num_tokens, s.num_drafts) for s in small.schedule().scheduled] == [(3, 2)]
    assert c.draft_token_ids == [1, 2]

    full = Scheduler(SchedulerConfig(max_num_batched_tokens=40), BlockManager(num_blocks=1, block_size=32))
    d = decoding(full, "d")
    plan = full.schedule()  # the proposals would need a second block, and there is none
    assert [(s.num_tokens, s.num_drafts) for s in plan.scheduled] == [(1, 0)] and not plan.preempted
    assert d.draft_token_ids == []
