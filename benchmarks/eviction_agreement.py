"""Secondary eviction metric: greedy agreement with the full-cache run, vinoserve and
openvino-genai's own eviction (rotation off: its rotation aborts or diverges, see shared docs).

Same windows as eviction_quality.py: prefill the first part, then generate greedily; report tokens
generated before the first divergence from the same engine's full-cache run, and the share of
positions that agree. f32 compute with an f32 cache for both engines (the only setting where
genai's eviction runs with every option).

    python benchmarks/eviction_agreement.py
"""
from __future__ import annotations

import argparse

import numpy as np
import openvino as ov

from vinoserve.bench.perplexity import text_windows
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.model.loader import resolve_model_dir
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
PROPS = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def ours(prompts, n: int, eviction: CacheEvictionConfig | None) -> list[list[int]]:
    llm = LLM(EngineConfig(compile=F32, cache_eviction=eviction, num_kv_blocks=len(prompts) * 80),
              log=lambda m: None)
    return [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))]


def genai(prompts, n: int, eviction: CacheEvictionConfig | None) -> list[list[int]]:
    import openvino_genai as g

    sched = g.SchedulerConfig()
    sched.num_kv_blocks = len(prompts) * 80
    if eviction is not None:
        sched.use_cache_eviction = True
        sched.cache_eviction_config = g.CacheEvictionConfig(
            eviction.start_size, eviction.recent_size, eviction.max_cache_size,
            g.AggregationMode.NORM_SUM if eviction.aggregation == "norm_sum" else g.AggregationMode.SUM,
            apply_rotation=False, snapkv_window_size=eviction.snapkv_window)
    pipe = g.ContinuousBatchingPipeline(str(resolve_model_dir(None, "f16", log=lambda m: None)), sched, "CPU", PROPS)
    cfg = g.GenerationConfig()
    cfg.max_new_tokens, cfg.ignore_eos, cfg.do_sample = n, True, False
    results = pipe.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts], [cfg] * len(prompts))
    return [list(r.m_generation_ids[0]) for r in results]


def agreement(runs: list[list[int]], refs: list[list[int]]) -> tuple[float, float]:
    first = [next((i for i, (a, b) in enumerate(zip(r, f)) if a != b), len(f)) for r, f in zip(runs, refs)]
    same = [np.mean([a == b for a, b in zip(r, f)]) for r, f in zip(runs, refs)]
    return float(np.mean(first)), float(np.mean(same))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=1744)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budgets", default="256,512,1024")
    args = ap.parse_args()
    windows, _ = text_windows(args.windows, args.prefill)
    print(f"SmolLM2-135M-Instruct, f32 + f32 cache, {args.windows} prompts of {args.prefill} tokens, "
          f"{args.tokens} greedy tokens, start 32 recent 128\n")
    print("| engine | budget | rotation | tokens before first divergence | positions agreeing |")
    print("| --- | --- | --- | --- | --- |")
    full_ours, full_genai = ours(windows, args.tokens, None), genai(windows, args.tokens, None)
    print(f"| genai full vs vinoserve full | - | - | {agreement(full_genai, full_ours)[0]:.1f} | "
          f"{agreement(full_genai, full_ours)[1]:.3f} |", flush=True)
    for budget in map(int, args.budgets.split(",")):
        for rotation in (True, False):
            cfg = CacheEvictionConfig(32, 128, budget, rotation=rotation)
            first, same = agreement(ours(windows, args.tokens, cfg), full_ours)
            print(f"| vinoserve | {budget} | {'on' if rotation else 'off'} | {first:.1f} | {same:.3f} |", flush=True)
        first, same = agreement(genai(windows, args.tokens, CacheEvictionConfig(32, 128, budget)), full_genai)
        print(f"| openvino-genai | {budget} | off | {first:.1f} | {same:.3f} |", flush=True)


if __name__ == "__main__":
    main()
