"""Output tokens/s of N concurrent streams: `vinoserve serve` against llama.cpp's server (xllamacpp,
N slots), the same GGUF, the same threads, the same load (`vinoserve bench serve`: N requests in
flight, each a random prompt of --input-len words and --output-len tokens, EOS ignored). Issue 57's
target: >= 2x llama.cpp's at 16 streams on the OLMoE-1B-7B shape.

    python benchmarks/served_streams.py --model olmoe-1b-7b-q4_0-random --streams 16 --threads 2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from vinoserve.bench.random_models import resolve
from vinoserve.bench.server_process import launch_server, stop_server


def _llamacpp_child(conn, model: str, threads: int, slots: int, n_ctx: int) -> None:
    import xllamacpp

    os.dup2(2, 1)
    params = xllamacpp.CommonParams()
    params.model.path, params.n_ctx, params.n_parallel = model, n_ctx, slots
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    server = xllamacpp.Server(params)
    conn.send(server.listening_address)
    conn.recv()
    del server


def _load(url: str, args: argparse.Namespace, out: Path) -> dict:
    """`vinoserve bench serve` against `url`, after a warm-up at the same concurrency (shapes
    compiled, buffers grown, outside the figures): the measured run's summary."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    for prompts, tokens in ((args.streams, 8), (args.prompts, args.output_len)):
        subprocess.run([sys.executable, "-m", "vinoserve.cli", "bench", "serve", "--base-url", url, "--model", model,
                        "--num-prompts", str(prompts), "--max-concurrency", str(args.streams),
                        "--input-len", str(args.input_len), "--output-len", str(tokens),
                        "--save-result", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF, or a random model's name (vinoserve.bench.random_models)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32, help="requests in all (--streams at a time)")
    ap.add_argument("--input-len", type=int, default=24, help="words per prompt")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    model = resolve(args.model)
    work = Path(tempfile.mkdtemp(prefix="streams-"))
    results = {}
    proc, url = launch_server(["--model", model, "--threads", str(args.threads)], work / "vinoserve.log", 1800)
    try:
        results["vinoserve"] = _load(url, args, work / "vinoserve.json")
    finally:
        stop_server(proc)
    conn, child = multiprocessing.get_context("spawn").Pipe()
    n_ctx = args.streams * (2 * args.input_len + args.output_len + 64)
    server = multiprocessing.get_context("spawn").Process(
        target=_llamacpp_child, args=(child, model, args.threads, args.streams, n_ctx), daemon=True)
    server.start()
    try:
        results["llama.cpp"] = _load(conn.recv().rstrip("/"), args, work / "llamacpp.json")
    finally:
        conn.send("stop")
        server.join(60)
    print(f"{args.model}: {args.streams} streams, {args.prompts} requests of {args.input_len} words -> "
          f"{args.output_len} tokens, {args.threads} threads each\n")
    print("| engine | output tok/s | TPOT ms (median) | TTFT ms (median) | failed |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['output_token_throughput']:.1f} | {r['tpot_ms']['median']:.0f} | "
              f"{r['ttft_ms']['median']:.0f} | {r['failed']} |")
    ratio = results["vinoserve"]["output_token_throughput"] / results["llama.cpp"]["output_token_throughput"]
    print(f"\nvinoserve / llama.cpp output tok/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
