"""Served TTFT / throughput / inter-token latency per `--max-num-batched-tokens`, paired.

One `vinoserve serve` process per budget, all started up front (idle ones take no CPU); each round
sends the same workload (fresh random prompts per round, so nothing is cached across rounds, and
prefix caching is off) to every server in turn, in an order that rotates between rounds. A
concurrency-limited closed loop: a new request starts whenever one finishes, so its prefill runs in
steps beside the other streams' decodes, which is where the budget matters: a step that carries a
prefill chunk of B tokens delays every running stream's next token by that chunk's compute.

    python benchmarks/batched_tokens.py --budgets 128,256,512,1024,2048 --rounds 3
    python benchmarks/batched_tokens.py --concurrency 8 --input-len 400 --range-ratio 0.9

Prints per budget the median over rounds of: output tok/s, TTFT median / p90, TPOT median,
ITL median / p99 (the stall a chunk causes), and the per-round ratio of output tok/s and median
TTFT against the reference budget.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import numpy as np

from vinoserve.bench.client import Target, run
from vinoserve.bench.metrics import summarize
from vinoserve.bench.server_process import launch_server, stop_server
from vinoserve.bench.workloads import random_workload

MODEL = "smollm2-135m-instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="128,256,512,1024,2048")
    ap.add_argument("--reference", type=int, default=256, help="the budget the ratios are taken against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256, help="mean words per prompt (about 1.3 tokens each)")
    ap.add_argument("--output-len", type=int, default=64, help="mean max_tokens")
    ap.add_argument("--range-ratio", type=float, default=0.9, help="lengths uniform in mean * [1 - r, 1 + r]")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `vinoserve serve` flags")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    extra = [a for a in args.serve_args if a != "--"]
    servers: dict[int, tuple] = {}
    try:
        for b in budgets:
            flags = ["--served-model-name", MODEL, "--max-num-batched-tokens", str(b), "--no-enable-prefix-caching",
                     "--log-level", "warning", *extra]
            servers[b] = launch_server(flags, Path(args.log_dir) / f"server-{b}.log", timeout=600)
        runs: dict[int, list[dict]] = {b: [] for b in budgets}
        for r in range(-1, args.rounds):  # round -1 warms every server up and is not counted
            n = args.num_prompts if r >= 0 else 4
            requests = random_workload(n, args.input_len, args.output_len, args.range_ratio, seed=1000 + r)
            order = budgets[r % len(budgets):] + budgets[:r % len(budgets)] if r >= 0 else budgets
            for b in order:
                records, duration = asyncio.run(run(Target(servers[b][1], MODEL), requests,
                                                    max_concurrency=args.concurrency))
                s = summarize(records, duration)
                if s["failed"]:
                    raise RuntimeError(f"budget {b}: {s['errors'][:3]}")
                if r >= 0:
                    runs[b].append(s)
                    print(f"round {r + 1} budget {b:>5}: {s['output_token_throughput']:6.1f} tok/s, TTFT median "
                          f"{s['ttft_ms']['median']:7.0f} ms, ITL p99 {s['itl_ms']['p99']:6.0f} ms", flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(f"\n{args.num_prompts} requests per round, concurrency {args.concurrency}, prompts {args.input_len} words "
          f"+- {args.range_ratio:.0%}, output {args.output_len} +- {args.range_ratio:.0%}; medians of {args.rounds} "
          f"rounds; ratios against budget {args.reference}: median [min, max] over rounds")
    print("| budget | output tok/s | TTFT median ms | TTFT p90 ms | TPOT median ms | ITL median ms | ITL p99 ms "
          "| tok/s ratio | TTFT ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ref = runs.get(args.reference)
    for b in budgets:
        row = runs[b]

        def med(key: str, stat: str | None = None) -> float:
            return statistics.median(s[key][stat] if stat else s[key] for s in row)

        line = (f"| {b} | {med('output_token_throughput'):.1f} | {med('ttft_ms', 'median'):.0f} | "
                f"{med('ttft_ms', 'p90'):.0f} | {med('tpot_ms', 'median'):.0f} | {med('itl_ms', 'median'):.0f} | "
                f"{med('itl_ms', 'p99'):.0f} |")
        if ref:
            tok = [s["output_token_throughput"] / t["output_token_throughput"] for s, t in zip(row, ref)]
            ttft = [s["ttft_ms"]["median"] / t["ttft_ms"]["median"] for s, t in zip(row, ref)]
            line += "".join(f" {np.median(v):.2f} [{min(v):.2f}, {max(v):.2f}] |" for v in (tok, ttft))
        print(line)


if __name__ == "__main__":
    main()
