"""Resident memory of `vinoserve serve` and of llama.cpp's server on the same GGUF, after one request.

Each server is started in a process of its own (vinoserve with a small KV cache, llama.cpp's
xllamacpp server with one slot and n_ctx 2048), answers one completion (256 prompt tokens of
English text, 32 out), and its VmRSS (with the anonymous and file-mapped parts) is read from
/proc; then it is stopped. One server at a time: the figures do not share the machine.

    python benchmarks/server_memory.py --model llama-1.5b-q4_0-random
    python benchmarks/server_memory.py --model m.gguf --weight-formats auto,f16 --kv-cache-size 0.25
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import httpx

from vinoserve.bench.llamacpp import gguf_path
from vinoserve.bench.server_process import free_port, memory_mib, stop_server, wait_healthy
from vinoserve.bench.workloads import stdlib_english

_LLAMA_SERVER = """
import sys, time, xllamacpp
p = xllamacpp.CommonParams()
p.model.path, p.n_ctx, p.n_parallel = sys.argv[1], 2048, 1
p.port = int(sys.argv[2])
s = xllamacpp.Server(p)
while True:
    time.sleep(3600)
"""


def measure(cmd: list[str], port: int, model_name: str, timeout: float = 1200) -> dict[str, int]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(proc, url, timeout):
            raise SystemExit("server did not become healthy")
        prompt = " ".join(stdlib_english().split()[:200])
        r = httpx.post(f"{url}/v1/completions", timeout=timeout, json={
            "model": model_name, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return {**memory_mib(proc.pid, ("VmRSS", "RssAnon", "RssFile")),
                "prompt_tokens": r.json()["usage"]["prompt_tokens"]}
    finally:
        stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help=".gguf file, built-in name or random model name")
    ap.add_argument("--weight-formats", default="auto")
    ap.add_argument("--kv-cache-size", default="0.25", help="vinoserve's KV cache, GB")
    ap.add_argument("--decode-models", default="auto", help="vinoserve's --decode-model settings (auto, off)")
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args()
    path = str(gguf_path(args.model))
    rows = {}
    if not args.no_llamacpp:
        port = free_port()
        rows["llama.cpp server (n_ctx 2048)"] = measure([sys.executable, "-c", _LLAMA_SERVER, path, str(port)],
                                                        port, "model")
    for fmt in args.weight_formats.split(","):
        for dm in args.decode_models.split(","):
            port = free_port()
            rows[f"vinoserve {fmt}, --decode-model {dm} (--kv-cache-size {args.kv_cache_size})"] = measure(
                [sys.executable, "-m", "vinoserve.cli", "serve", "--model", path, "--port", str(port),
                 "--weight-format", fmt, "--decode-model", dm, "--kv-cache-size", args.kv_cache_size,
                 "--served-model-name", "model"], port, "model")
    print(f"{os.path.basename(path)}, one completion ({next(iter(rows.values()))['prompt_tokens']} prompt tokens, "
          f"32 out), {os.cpu_count()} CPUs\n")
    print("| server | VmRSS MiB | anonymous | file-mapped |")
    print("| --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['VmRSS']:,} | {r['RssAnon']:,} | {r['RssFile']:,} |")


if __name__ == "__main__":
    main()
