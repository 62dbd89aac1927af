"""`vinoserve bench serve` (load-test any OpenAI-compatible server), `bench engine`, `bench llamacpp`,
`bench soak`, `bench longctx`, `bench embed`, `bench vision`."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tqdm import tqdm

from vinoserve.bench import embed, engine_vs_genai, llamacpp, longctx, soak, vision
from vinoserve.bench.client import Target, run
from vinoserve.bench.metrics import Goodput, summarize
from vinoserve.bench.workloads import (multi_turn_workload, prefix_repetition_workload, random_workload,
                                       sharegpt_workload, text_file_workload)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: load-test a server, or compare engines offline")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="load-test an OpenAI-compatible server over streaming completions")
    _serve_arguments(serve)
    engine = kinds.add_parser("engine", help="vinoserve's engine vs openvino-genai's CB pipeline, offline")
    engine_vs_genai.add_arguments(engine)
    llama = kinds.add_parser("llamacpp", help="single-stream decode and prompt tok/s: llama.cpp vs vinoserve, same GGUF")
    llamacpp.add_arguments(llama)
    embedder = kinds.add_parser("embed", help="embedding throughput and query latency: vinoserve vs "
                                              "sentence-transformers and llama.cpp, same model")
    embed.add_arguments(embedder)
    soaker = kinds.add_parser("soak", help="mixed requests with random disconnects; fails on 5xx, leaks, tracebacks")
    soak.add_arguments(soaker)
    longctx.add_arguments(kinds.add_parser("longctx", help="long-context retrieval under cache eviction: vinoserve's "
                                                          "policies vs full cache, start + recent and openvino-genai"))
    vision.add_arguments(kinds.add_parser("vision", help="a 1-image chat request's TTFT, vinoserve vs llama.cpp (same "
                                                        "GGUF + mmproj), and decoding's TPOT beside image requests"))


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model id the server expects")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", choices=("random", "sharegpt", "prefix-repetition", "text", "multi-turn"),
                   default="random")
    p.add_argument("--dataset-path", type=Path, help="ShareGPT JSON or plain text file")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="words per prompt (about 1.3 tokens each)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by +- this fraction")
    p.add_argument("--prefix-len", type=int, default=512, help="prefix-repetition: shared prefix words")
    p.add_argument("--turns", type=int, default=4,
                   help="multi-turn: turns per conversation (--num-prompts conversations; --prefix-len words "
                        "in the first turn, --input-len words in each later user message)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore_eos, so lengths are exact)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy; chat clients sample)")
    p.add_argument("--top-p", type=float, default=None, help="top_p of every request (default: not sent)")
    p.add_argument("--top-k", type=int, default=None, help="top_k of every request, vLLM's extension (default: not sent)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--sweep", default=None, metavar="V1,V2,...",
                   help="run once per value of --sweep-over (e.g. 1,16,64)")
    p.add_argument("--sweep-over", choices=("max-concurrency", "request-rate"), default="max-concurrency")
    p.add_argument("--goodput", default=None, metavar="ttft:MS,tpot:MS,e2el:MS")
    p.add_argument("--save-result", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG of a sweep's curves (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)


def workload(args: argparse.Namespace):
    if args.workload == "random":
        return random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    if args.workload == "multi-turn":
        return multi_turn_workload(args.num_prompts, args.turns, args.prefix_len, args.input_len, args.output_len,
                                   seed=args.seed)
    if args.workload == "prefix-repetition":
        return prefix_repetition_workload(args.num_prompts, args.prefix_len, args.input_len, args.output_len,
                                          seed=args.seed)
    if args.dataset_path is None:
        raise ValueError(f"--workload {args.workload} needs --dataset-path")
    if args.workload == "sharegpt":
        return sharegpt_workload(args.dataset_path, args.num_prompts, args.output_len, args.seed)
    return text_file_workload(args.dataset_path, args.num_prompts, args.input_len, args.output_len)


def bench_serve(args: argparse.Namespace) -> dict:
    goodput = Goodput.parse(args.goodput)
    requests = workload(args)
    target = Target(args.base_url.rstrip("/"), args.model, args.api_key, args.ignore_eos,
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    values = [float(v) for v in args.sweep.split(",")] if args.sweep else [None]
    runs = []
    for value in values:
        rate, conc = args.request_rate, args.max_concurrency
        if value is not None:
            if args.sweep_over == "request-rate":
                rate = value
            else:
                conc = int(value)
        with tqdm(total=len(requests), desc=f"rate {rate} conc {conc}", file=sys.stderr, disable=None) as bar:
            records, duration = asyncio.run(run(target, requests, rate, args.burstiness, conc,
                                                on_done=lambda _: bar.update(), seed=args.seed))
        summary = summarize(records, duration, goodput)
        summary.update(request_rate=rate, max_concurrency=conc)
        runs.append({"summary": summary, "requests": [r.__dict__ for r in records]})
        print(report(summary))
    result = {"base_url": args.base_url, "model": args.model, "workload": args.workload,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "runs": runs}
    if args.save_result:
        args.save_result.write_text(json.dumps(result, indent=2, default=_json_number))
    if args.plot:
        plot(runs, args.plot)
    return result


def _json_number(x):
    return float(x)


def report(s: dict) -> str:
    lines = [f"{'=' * 20} rate {s['request_rate']} concurrency {s['max_concurrency']} {'=' * 20}",
             f"completed / failed:            {s['completed']} / {s['failed']}",
             f"duration (s):                  {s['duration_s']:.2f}",
             f"input / output tokens:         {s['total_input_tokens']} / {s['total_output_tokens']}",
             f"request throughput (req/s):    {s['request_throughput']:.2f}",
             f"output throughput (tok/s):     {s['output_token_throughput']:.1f}",
             f"input throughput (tok/s):      {s['input_token_throughput']:.1f}"]
    for key, label in (("ttft_first_turn_ms", "TTFT, first turns"), ("ttft_follow_up_ms", "TTFT, follow-ups")):
        if key in s:
            lines.append(f"{label + ' (ms):':<31}median {s[key]['median']:.1f}, mean {s[key]['mean']:.1f}")
    if s.get("total_cached_tokens"):
        lines.append(f"cached prompt tokens:          {s['total_cached_tokens']}")
    if "goodput" in s:
        lines.append(f"goodput (req/s):               {s['goodput']:.2f}")
    lines.append(f"{'(ms)':<10}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        p = s[key]
        lines.append(f"{key[:-3].upper():<10}{p['mean']:>10.1f}{p['median']:>10.1f}{p['p90']:>10.1f}{p['p99']:>10.1f}")
    for e in s["errors"][:5]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'vinoserve[plot]'") from e
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    thr = [r["summary"]["output_token_throughput"] for r in runs]
    for key, label in (("ttft_ms", "TTFT p50"), ("tpot_ms", "TPOT p50")):
        ax1.plot(thr, [r["summary"][key]["median"] for r in runs], marker="o", label=label)
    ax1.set(xlabel="output tokens/s", ylabel="ms", title="latency vs throughput")
    ax1.legend()
    last = runs[-1]["requests"]
    ttfts = [1000 * (r["chunk_times"][0] - r["start"]) for r in last if r["chunk_times"]]
    itls = [1000 * (b - a) for r in last for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    ax2.hist([ttfts, itls], bins=40, label=["TTFT", "ITL"], log=True)
    ax2.set(xlabel="ms", title="distributions (last run)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    if args.bench_command == "soak":
        return soak.main(args)
    if args.bench_command == "engine":
        engine_vs_genai.main(args)
    elif args.bench_command == "llamacpp":
        llamacpp.main(args)
    elif args.bench_command == "longctx":
        longctx.main(args)
    elif args.bench_command == "embed":
        embed.main(args)
    elif args.bench_command == "vision":
        vision.main(args)
    else:
        bench_serve(args)
    return 0
