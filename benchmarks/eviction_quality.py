"""Quality of KV-cache eviction, teacher-forced, on SmolLM2-135M-Instruct.

For each ~2,000-token window of real English text, the engine prefills the first part, then the
true next tokens are fed one decode step at a time (eviction active, exactly as in generation)
and the log-probability the model gave each true token is recorded. Reported: perplexity with
eviction / perplexity with the full cache, per budget, aggregation, rotation on/off, precision;
and the peak KV blocks a sequence held per layer while decoding.

    python benchmarks/eviction_quality.py                    # the table in docs/eviction.md
    python benchmarks/eviction_quality.py --windows 2 --budgets 256   # a quick look
"""
from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import replace

from vinoserve.bench.longctx import OURS
from vinoserve.bench.perplexity import perplexity as run
from vinoserve.bench.perplexity import text_windows
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.model.compile_options import CompileOptions

PRECISIONS = {"f32": CompileOptions(inference_precision="f32", kv_cache_precision="f32"),
              "fast": CompileOptions(inference_precision="bf16", kv_cache_precision="u8"),
              "default": CompileOptions()}  # the plugin's choice for this CPU


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-len", type=int, default=2000)
    ap.add_argument("--forced", type=int, default=256, help="true tokens fed one decode step at a time")
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--start", type=int, default=32)
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--precisions", default="f32,fast")
    ap.add_argument("--policies", default="ours,blocks,streaming",
                    help="ours (the long-context benchmark's choice), blocks, streaming")
    ap.add_argument("--aggregations", default="norm_sum")
    args = ap.parse_args()

    windows, available = text_windows(args.windows, args.window_len)
    prefill = args.window_len - args.forced
    print(f"SmolLM2-135M-Instruct, {args.windows} windows x {args.window_len} tokens of English text "
          f"({available} available), prefill {prefill}, {args.forced} teacher-forced decode steps, "
          f"start {args.start} recent {args.recent}\n")
    print("| precision | budget | policy | aggregation | rotation | perplexity | ratio to full | peak blocks/layer in decode |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.precisions.split(","):
        options = PRECISIONS[name]
        start = time.perf_counter()
        full = run(windows, prefill, options, None)
        print(f"| {name} | full | - | - | - | {full.perplexity:.3f} | 1.000 | {full.peak_blocks} |", flush=True)
        for budget, policy, agg, rot in itertools.product(map(int, args.budgets.split(",")), args.policies.split(","),
                                                          args.aggregations.split(","), (True, False)):
            base = OURS if policy == "ours" else CacheEvictionConfig(policy=policy)
            if policy == "streaming" and agg != args.aggregations.split(",")[0]:
                continue  # streaming uses no scores
            cfg = replace(base, start_size=args.start, recent_size=args.recent, max_cache_size=budget,
                          aggregation=agg, rotation=rot)
            r = run(windows, prefill, options, cfg)
            print(f"| {name} | {budget} | {policy} | {agg} | {'on' if rot else 'off'} | {r.perplexity:.3f} | "
                  f"{r.perplexity / full.perplexity:.3f} | {r.peak_blocks} |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - start:.0f} s -->")


if __name__ == "__main__":
    main()
