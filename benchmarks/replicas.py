"""`vinoserve serve --replicas` measured with `vinoserve bench serve`, configurations interleaved
(A B A B ...) so that a shared machine's drift falls on both; each server started afresh, so no
run finds another's prefix cache. Prints each run and the median ratio of each pair to the first.

  policy   2 replicas, cache-aware vs round-robin router
  layout   2 replicas of half the cores (cache-aware) vs 1 process on all of them

    python benchmarks/replicas.py policy --workload multi-turn --pairs 3
    python benchmarks/replicas.py policy --workload long-multi-turn --pairs 3 --kv-cache-size 0.5
    python benchmarks/replicas.py policy --workload prefix-repetition --pairs 3
    python benchmarks/replicas.py layout --workload multi-turn --pairs 3

Extra arguments after `--` go to `vinoserve bench serve` (sizes, rates), e.g.
`-- --num-prompts 8 --turns 4 --prefix-len 300 --input-len 40 --output-len 24`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

PORT = 18400
MODEL = "smollm2-135m-instruct"
CONFIGS = {
    "policy": {"cache-aware": ["--replicas", "2", "--router-policy", "cache-aware"],
               "round-robin": ["--replicas", "2", "--router-policy", "round-robin"]},
    "layout": {"2 replicas": ["--replicas", "2"], "1 process": []},
}
WORKLOADS = {  # name: (`vinoserve bench serve --workload`, its default sizes)
    "multi-turn": ("multi-turn", ["--num-prompts", "8", "--turns", "4", "--prefix-len", "300", "--input-len", "40",
                   "--output-len", "24"]),
    "long-multi-turn": ("multi-turn", ["--num-prompts", "6", "--turns", "3", "--prefix-len", "1500",
                                       "--input-len", "50", "--output-len", "16"]),
    "prefix-repetition": ("prefix-repetition", ["--num-prompts", "32", "--prefix-len", "300", "--input-len", "30",
                                                "--output-len", "24", "--request-rate", "2"]),
}


def _ready(replicated: bool) -> bool:
    try:
        if replicated:
            r = httpx.get(f"http://127.0.0.1:{PORT}/readiness", timeout=2)
            return r.status_code == 200 and r.json().get("healthy_workers") == 2
        return httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _prompt_tokens(url: str) -> float:
    """Prompt tokens one server processed: how the work was split between replicas."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        if family.name == "vllm:prompt_tokens":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0


def one_run(serve_args: list[str], workload: str, bench_args: list[str], kv_gb: float) -> dict:
    cmd = [sys.executable, "-m", "vinoserve.cli", "serve", "--port", str(PORT), "--kv-cache-size", str(kv_gb),
           *serve_args]
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not _ready("--replicas" in serve_args):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd)} did not start")
            time.sleep(0.5)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            subprocess.run([sys.executable, "-m", "vinoserve.cli", "bench", "serve", "--base-url",
                            f"http://127.0.0.1:{PORT}", "--model", MODEL, "--workload", workload,
                            "--save-result", str(out), *bench_args], check=True, stdout=subprocess.DEVNULL)
            s = json.loads(out.read_text())["runs"][0]["summary"]
        log.seek(0)  # the supervisor names each replica's port
        urls = re.findall(r"replica \d+: pid .*?(http://127\.0\.0\.1:\d+)", log.read()) or [f"http://127.0.0.1:{PORT}"]
        split = [_prompt_tokens(u) for u in urls]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    ttft = s.get("ttft_follow_up_ms", s["ttft_ms"])["median"]
    first = s.get("ttft_first_turn_ms", s["ttft_ms"])["median"]
    return {"ttft_ms": ttft, "first_ttft_ms": first, "tok_s": s["output_token_throughput"], "failed": s["failed"],
            "cached_share": s["total_cached_tokens"] / max(1, s["total_input_tokens"]),
            "split": "/".join(f"{x / max(1.0, sum(split)):.0%}" for x in split)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("compare", choices=tuple(CONFIGS))
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="multi-turn")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--kv-cache-size", type=float, default=0.3, help="GB per replica (the single process gets twice)")
    p.add_argument("bench_args", nargs="*", help="after --: passed to `vinoserve bench serve`")
    args = p.parse_args()
    workload, defaults = WORKLOADS[args.workload]
    bench_args = args.bench_args or defaults
    configs = CONFIGS[args.compare]
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    print(f"{os.uname().nodename}, {os.cpu_count()} CPUs; {args.workload}: {' '.join(bench_args)}")
    for i in range(args.pairs):
        for name, serve_args in configs.items():
            kv = args.kv_cache_size * (1 if "--replicas" in serve_args else 2)
            r = one_run(serve_args, workload, bench_args, kv)
            runs[name].append(r)
            print(f"pair {i + 1} {name:>12}: median TTFT {r['ttft_ms']:7.1f} ms (follow-ups; first turns "
                  f"{r['first_ttft_ms']:7.1f}), cached {r['cached_share']:.1%} of prompt tokens, {r['tok_s']:5.1f} "
                  f"output tok/s, prompt tokens per server {r['split']}, {r['failed']} failed", flush=True)
    first, *others = configs
    for name in others:
        for key in ("ttft_ms", "tok_s"):
            ratios = [b[key] / a[key] for a, b in zip(runs[first], runs[name])]
            print(f"{name} / {first} {key}: median {statistics.median(ratios):.2f} "
                  f"(pairs: {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
