"""Per-step cost of grammar masks in the sampler, beside the engine's own step time.

For B constrained sequences (JSON schema) and a vocabulary of V tokens, times Sampler.sample over
[B, V] logits with and without grammars (paired, interleaved, medians of repeats): the difference
is what structured outputs add to a step (batched mask fill, masking, advancing the matchers).
The sampler runs on random logits, a worst case for the grammar (random tokens in free strings).
Beside it, the engine's decode step for B SmolLM2 sequences, free and held to the same schema.

    PYTHONPATH=. python benchmarks/grammar_masks.py [--repeats 5] [--steps 40]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.scheduler.grammar import GrammarCompiler, GrammarSpec
from vinoserve.scheduler.sampler import Sampler, SamplingState
from vinoserve.scheduler.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8}},
    "required": ["name", "age", "address", "tags"]}


def synthetic_vocab(tokens: list[bytes], size: int, rng: np.random.Generator) -> list[bytes]:
    """`tokens` grown to `size` entries with concatenations of two of its text tokens (a BPE-like tail)."""
    text = [t for t in tokens[17:] if t]
    extra = {text[a] + text[b] for a, b in rng.integers(0, len(text), (size * 2, 2))} - set(tokens)
    return tokens + sorted(extra)[:size - len(tokens)]


def sample_cost(compiler: GrammarCompiler, vocab: int, batch: int, steps: int, rng: np.random.Generator,
                guided: bool) -> float:
    """Median seconds of one Sampler.sample over `batch` rows for `steps` steps."""
    sampler, spec = Sampler(), GrammarSpec.json_schema(SCHEMA)
    params = SamplingParams(max_tokens=steps + 1, temperature=1.0, top_k=50, seed=0)
    rows = [SamplingState(params, [1], [], (2,), compiler.matcher(spec) if guided else None) for _ in range(batch)]
    times = []
    for _ in range(steps):
        logits = rng.standard_normal((batch, vocab), dtype=np.float32)
        start = time.perf_counter()
        sampler.sample(logits, rows)
        times.append(time.perf_counter() - start)
        for r in rows:  # a finished object is restarted, so every step measures a live grammar
            if r.grammar is not None and r.grammar.matcher.is_stopped():
                r.grammar = compiler.matcher(spec)
    return statistics.median(times)


def engine_step(engine: LLMEngine, batch: int, steps: int, guided: bool) -> float:
    """Mean seconds per decode step of `batch` sampled sequences (prefill excluded), each held to
    SCHEMA when `guided`: the model's own tokens, so the grammar states are realistic ones."""
    grammar = GrammarSpec.json_schema(SCHEMA) if guided else None
    for i in range(batch):
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Describe person {i} in JSON."}])
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", prompt,
                           SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=i, ignore_eos=True,
                                          grammar=grammar))
    engine.step()
    while engine.stats.num_generated_tokens == 0 or any(not r.seq.output_token_ids for r in engine._requests.values()):
        engine.step()
    before_steps, before_time = engine.stats.num_steps, engine.stats.step_seconds
    while engine.has_unfinished_requests:
        engine.step()
    return (engine.stats.step_seconds - before_time) / max(1, engine.stats.num_steps - before_steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="sampler steps per measurement")
    ap.add_argument("--engine-steps", type=int, default=16, help="engine decode steps per measurement")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    engine = LLMEngine(EngineConfig(), log=lambda m: None)
    tok = engine.tokenizer
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    special = sorted(tok.special_token_ids)
    vocabs = {"SmolLM2 49,152": tok.token_bytes, "synthetic 151,936": synthetic_vocab(tok.token_bytes, 151936, rng)}
    print("CPU:", open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" \t:"))
    print(f"{'vocab':>18} {'B':>3} {'sample ms':>10} {'guided ms':>10} {'grammar ms':>11} "
          f"{'engine step ms':>15} {'guided step ms':>15}")
    for name, tokens in vocabs.items():
        compiler = GrammarCompiler(tokens, len(tokens), engine.eos_token_ids, special, encode)
        for batch in (1, 16, 64):
            plain, guided, step, guided_step = [], [], [], []
            for _ in range(args.repeats):  # interleaved, so drifting load hits both alike
                plain.append(sample_cost(compiler, len(tokens), batch, args.steps, rng, False))
                guided.append(sample_cost(compiler, len(tokens), batch, args.steps, rng, True))
                if name.startswith("SmolLM2"):
                    step.append(engine_step(engine, batch, args.engine_steps, False))
                    guided_step.append(engine_step(engine, batch, args.engine_steps, True))
            p, g = statistics.median(plain), statistics.median(guided)
            steps = "".join(f"{statistics.median(x) * 1e3:16.2f}" if x else f"{'-':>16}" for x in (step, guided_step))
            print(f"{name:>18} {batch:3d} {p * 1e3:10.3f} {g * 1e3:10.3f} {(g - p) * 1e3:11.3f}{steps}", flush=True)


if __name__ == "__main__":
    main()
