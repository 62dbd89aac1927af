"""Long prompts in bounded memory: cache eviction during chunked prefill against full caches.

  tpot      one session at a time, prompts of 1K..8K tokens: time per output token and the peak
            KV one sequence held (bytes, all layers), full cache vs eviction during prefill
  capacity  N 8K-token sessions at once in a fixed KV pool (--pool-sessions full 8K sessions'
            worth of blocks): how many hold KV at once at most (outputs long enough that memory
            is what limits it), preemptions, the most blocks one held, wall time

    python benchmarks/long_prompt_capacity.py tpot --lengths 1024 2048 4096 8000 --repeats 3
    python benchmarks/long_prompt_capacity.py capacity --sessions 12 --pool-sessions 2

The built-in model (SmolLM2-135M-Instruct, 8K context) by default, at the CPU's default precisions;
prompts are random token ids (what is measured here is memory and time, not what survives:
`vinoserve bench longctx` measures that). Eviction: start 32, recent 128, budget --budget tokens,
--policy as `vinoserve serve --eviction-policy` runs it (default: tokens, the benchmark's choice).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig


def make_engine(args, evict: bool, blocks: int | None, max_seqs: int = 256) -> LLMEngine:
    eviction = CacheEvictionConfig.parse(f"32,128,{args.budget}", args.policy, during_prefill=True) if evict else None
    return LLMEngine(EngineConfig(args.model, num_kv_blocks=blocks, cache_eviction=eviction,
                                  scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=args.chunk)),
                     log=lambda m: None)


def record_peak(engine: LLMEngine) -> dict[str, int]:
    """Most blocks each sequence held in one layer while a step computed."""
    peak: dict[str, int] = {}
    prepare = engine.runner.prepare
    ids = {}

    def recording(chunks, *rest):
        for c in chunks:
            key = ids.get(id(c.block_tables))
            if key is None:
                key = ids[id(c.block_tables)] = next(r.seq.request_id for r in engine._requests.values()
                                                     if r.seq.block_tables is c.block_tables)
            peak[key] = max(peak.get(key, 0), max(len(t) for t in c.block_tables))
        return prepare(chunks, *rest)
    engine.runner.prepare = recording
    return peak


def prompt(rng, engine: LLMEngine, n: int) -> list[int]:
    return rng.integers(100, engine.model.config.vocab_size - 100, n).tolist()


def decode_ms(engine: LLMEngine, ids: list[int], out: int) -> tuple[float, int]:
    """(milliseconds per output token after the first, the most blocks it held in a layer)."""
    peak = record_peak(engine)
    engine.add_request("r", ids, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0))
    first = done = None
    while engine.has_unfinished_requests:
        for o in engine.step():
            if first is None and o.new_token_ids:
                first = time.perf_counter()
            if o.finished:
                done = time.perf_counter()
    del engine.runner.prepare  # the recording wrapper
    return (done - first) / (out - 1) * 1e3, peak["r"]


def tpot(args) -> None:
    rng = np.random.default_rng(0)
    blocks = -(-8192 // 32) + 1  # one full 8K sequence, whatever memory is free now
    engines = {"full": make_engine(args, False, blocks, 1), "evict": make_engine(args, True, blocks, 1)}
    engines = {k: e for k, e in engines.items() if k in args.engines}
    per_block = {k: e.cache.layout.bytes_per_block() * e.model.config.num_layers for k, e in engines.items()}
    ids = {n: prompt(rng, next(iter(engines.values())), n) for n in args.lengths}
    got: dict[tuple[str, int], list] = {}
    for _ in range(args.repeats):  # rounds over every length and engine, so load drifts hit all alike
        for n in args.lengths:
            for name, engine in engines.items():
                got.setdefault((name, n), []).append(decode_ms(engine, ids[n], args.out))
    cells = {k: (statistics.median(t for t, _ in v), max(p for _, p in v)) for k, v in got.items()}
    print("| engine | prompt | TPOT ms (median of " + str(args.repeats) + ") | vs the shortest prompt | peak KV MiB |")
    print("| --- | --- | --- | --- | --- |")
    for name in engines:
        base = cells[(name, args.lengths[0])][0]
        for n in args.lengths:
            t, peak = cells[(name, n)]
            print(f"| {name} | {n} | {t:.2f} | {t / base:.2f} | {peak * per_block[name] / 2**20:.1f} |")


def capacity(args) -> None:
    rng = np.random.default_rng(1)
    length = 8192 - args.out
    print("| cache | pool blocks | sessions | most running at once | preemptions | peak blocks/seq | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    probe = None
    for evict in (False, True):
        blocks = args.pool_sessions * -(-8192 // 32)
        engine = make_engine(args, evict, blocks)
        probe = probe or [prompt(rng, engine, length) for _ in range(args.sessions)]
        peak = record_peak(engine)
        for i, ids in enumerate(probe):
            engine.add_request(str(i), ids, SamplingParams(max_tokens=args.out, ignore_eos=True, temperature=0))
        most, start = 0, time.perf_counter()
        while engine.has_unfinished_requests:
            engine.step()
            most = max(most, len(engine.scheduler.running))
        wall = time.perf_counter() - start
        print(f"| {'evict during prefill, budget ' + str(args.budget) if evict else 'full'} | {blocks} | "
              f"{args.sessions} | {most} | {engine.scheduler.num_preemptions} | {max(peak.values())} | {wall:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("tpot", "capacity"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", type=int, default=1024, help="max_cache_size, tokens")
    ap.add_argument("--policy", choices=("tokens", "blocks", "streaming"), default="tokens")
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--out", type=int, default=64, help="tokens generated per session")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", nargs="+", choices=("full", "evict"), default=["full", "evict"])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--pool-sessions", type=int, default=2, help="the pool holds this many full 8K sessions")
    args = ap.parse_args()
    (tpot if args.mode == "tpot" else capacity)(args)


if __name__ == "__main__":
    main()
