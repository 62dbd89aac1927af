"""Prefix caching benchmarks, paired in one process, each measurement repeated:

  followup  TTFT of a follow-up chat turn on a long history, prefix caching on vs off
  shared    N prompts = one shared prefix + distinct tails, arriving together or staggered:
            vinoserve (prefix caching on / off) vs openvino-genai's ContinuousBatchingPipeline
            (enable_prefix_caching on / off), generated tokens per second
  random    throughput on random prompts that share nothing, prefix caching on vs off

    python benchmarks/prefix_cache.py followup --history 2000
    python benchmarks/prefix_cache.py shared --prompts 32 --prefix 1024 --tail 64 --out 64
    python benchmarks/prefix_cache.py random --prompts 32 --input-len 256 --out 64
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np

from vinoserve.bench.engine_vs_genai import QWEN2_05B, random_qwen2_gguf
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.loader import resolve_model_dir
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.storage import cache_root
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig


def model_dir(name: str):
    if name == "qwen2-0.5b-random":
        bench = cache_root() / "bench"
        bench.mkdir(parents=True, exist_ok=True)
        name = str(random_qwen2_gguf(bench / "qwen2-0.5b-random.gguf", QWEN2_05B))
    return resolve_model_dir(None if name == "default" else name, "f16")


def engine(path, prefix: bool, blocks: int, budget: int, kv: str) -> LLMEngine:
    cfg = EngineConfig(model=str(path), num_kv_blocks=blocks, enable_prefix_caching=prefix,
                       compile=CompileOptions(kv_cache_precision=kv),
                       scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget))
    return LLMEngine(cfg, log=lambda m: None)


def run(eng: LLMEngine, prompts, out_len: int, arrivals: list[int]) -> tuple[float, list[float]]:
    """Adds prompt i before step arrivals[i]; returns (seconds, TTFT of each request)."""
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    added, first, step = {}, {}, 0
    start = time.perf_counter()
    while step <= max(arrivals) or eng.has_unfinished_requests:
        for i, at in enumerate(arrivals):
            if at == step:
                eng.add_request(f"r{i}", prompts[i], params)
                added[f"r{i}"] = time.perf_counter()
        for o in eng.step():
            first.setdefault(o.request_id, time.perf_counter())
        step += 1
    return time.perf_counter() - start, [first[r] - added[r] for r in added]


def vocab_of(eng: LLMEngine) -> int:
    return eng.model.config.vocab_size


def followup(args) -> None:
    path = model_dir(args.model)
    blocks = 4 * math.ceil((args.history + args.turn + 2 * args.out) / 32) + 8
    engines = {p: engine(path, p, blocks, args.budget, args.kv) for p in (True, False)}
    rng = np.random.default_rng(0)
    vocab = vocab_of(engines[True])
    times = {True: [], False: []}
    for rep in range(args.repeats):
        history = rng.integers(0, vocab, args.history).tolist()
        turn = rng.integers(0, vocab, args.turn).tolist()
        for p in (True, False) if rep % 2 == 0 else (False, True):
            eng = engines[p]
            answer = []
            eng.add_request("t1", history, SamplingParams(max_tokens=args.out, temperature=0, ignore_eos=True))
            while eng.has_unfinished_requests:
                answer += [t for o in eng.step() for t in o.new_token_ids]
            _, ttft = run(eng, [history + answer + turn], args.out, [0])
            times[p].append(ttft[0])
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"follow-up turn after a {args.history}-token history (+{args.out} answer, +{args.turn} new): "
          f"TTFT median on {1e3 * on:.1f} ms, off {1e3 * off:.1f} ms, off/on {off / on:.1f}x "
          f"({args.repeats} paired repeats; on {[round(1e3 * t) for t in times[True]]}, "
          f"off {[round(1e3 * t) for t in times[False]]})")


def genai_run(path, prompts, out_len: int, arrivals: list[int], blocks: int, budget: int, kv: str,
              prefix: bool) -> float:
    import openvino as ov
    import openvino_genai as genai

    sched = genai.SchedulerConfig()
    sched.num_kv_blocks, sched.max_num_batched_tokens, sched.max_num_seqs = blocks, budget, 256
    sched.enable_prefix_caching = prefix
    pipe = genai.ContinuousBatchingPipeline(str(path), sched, "CPU", {"KV_CACHE_PRECISION": kv})
    cfg = genai.GenerationConfig()
    cfg.max_new_tokens, cfg.ignore_eos, cfg.do_sample = out_len, True, False
    warm = genai.GenerationConfig()
    warm.max_new_tokens, warm.ignore_eos, warm.do_sample = 4, True, False
    pipe.generate([ov.Tensor(np.array([prompts[0][-40:]], dtype=np.int64))], [warm])
    handles, step = [], 0
    start = time.perf_counter()
    while step <= max(arrivals) or pipe.has_non_finished_requests():
        for i, at in enumerate(arrivals):
            if at == step:
                handles.append(pipe.add_request(i, ov.Tensor(np.array([prompts[i]], dtype=np.int64)), cfg))
        pipe.step()
        step += 1
    elapsed = time.perf_counter() - start
    assert all(len(h.read_all()[0].generated_ids) == out_len for h in handles)
    return elapsed


def shared(args) -> None:
    path = model_dir(args.model)
    blocks = args.prompts * math.ceil((args.prefix + args.tail + args.out) / 32) + 8
    rng = np.random.default_rng(0)
    eng = engine(path, True, blocks, args.budget, args.kv)
    vocab = vocab_of(eng)
    del eng
    prefix = rng.integers(0, vocab, args.prefix).tolist()
    prompts = [prefix + rng.integers(0, vocab, args.tail).tolist() for _ in range(args.prompts)]
    gen = args.prompts * args.out
    print(f"{path.name}: {args.prompts} prompts = {args.prefix} shared + {args.tail} own tokens, {args.out} out, "
          f"budget {args.budget}, {args.kv} KV, {os.cpu_count()} CPUs")
    for name, arrivals in (("together", [0] * args.prompts),
                           ("staggered", [i * args.stagger for i in range(args.prompts)])):
        results: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            for label in ("vinoserve prefix on", "vinoserve prefix off", "genai prefix on", "genai prefix off"):
                if args.skip_off and label.endswith("off"):
                    continue
                if label.startswith("vinoserve"):
                    eng = engine(path, label.endswith("on"), blocks, args.budget, args.kv)
                    run(eng, [prompts[0][-40:]], 4, [0])  # warm-up, shares nothing with the workload
                    seconds, _ = run(eng, prompts, args.out, arrivals)
                    del eng
                else:
                    seconds = genai_run(path, prompts, args.out, arrivals, blocks, args.budget, args.kv,
                                        label.endswith("on"))
                results.setdefault(label, []).append(gen / seconds)
                print(f"  {name:9} rep {rep}: {label:21} {gen / seconds:7.1f} tok/s ({seconds:.1f} s)", flush=True)
        med = {k: statistics.median(v) for k, v in results.items()}
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f"; vinoserve/genai (both prefix on) {med['vinoserve prefix on'] / med['genai prefix on']:.2f}x")


def random_workload(args) -> None:
    path = model_dir(args.model)
    blocks = args.prompts * math.ceil((args.input_len + args.out) / 32) + 8
    engines = {p: engine(path, p, blocks, args.budget, args.kv) for p in (True, False)}
    vocab = vocab_of(engines[True])
    rates = {True: [], False: []}
    for rep in range(args.repeats):
        rng = np.random.default_rng(rep)
        prompts = rng.integers(0, vocab, (args.prompts, args.input_len)).tolist()
        for p in (True, False) if rep % 2 == 0 else (False, True):
            seconds, _ = run(engines[p], prompts, args.out, [0] * args.prompts)
            rates[p].append(args.prompts * args.out / seconds)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"random {args.prompts} x ({args.input_len} in, {args.out} out): on {on:.1f} tok/s, off {off:.1f} tok/s, "
          f"on/off {on / off:.3f} (per repeat on {[round(r, 1) for r in rates[True]]}, "
          f"off {[round(r, 1) for r in rates[False]]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("followup", "shared", "random"))
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M), a .gguf, or 'qwen2-0.5b-random'")
    ap.add_argument("--kv", default="bf16", help="KV cache precision for both engines")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--turn", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--stagger", type=int, default=2, help="staggered: steps between arrivals")
    ap.add_argument("--skip-off", action="store_true", help="shared: only the prefix-caching-on runs")
    args = ap.parse_args()
    {"followup": followup, "shared": shared, "random": random_workload}[args.what](args)


if __name__ == "__main__":
    main()
