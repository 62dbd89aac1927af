"""`vinoserve bench embed --beside-chat`: what embedding traffic costs a chat model's decoding on
the same server. One server serves the chat model and the embedder; 4 streams decode while 32
clients send embedding requests back to back (each a ~256-token document), against the same 4
streams alone. Rounds alternate the two; the report gives time per output token (TPOT) each way,
their ratio (the target: within 1.5x), and the embedding throughput reached meanwhile."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from vinoserve.bench.embed_inputs import default_model_dir, texts_of_tokens
from vinoserve.bench.server_process import launch_server, stop_server
from vinoserve.model.encoders.model import display_name

STREAMS, EMBED_CLIENTS = 4, 32


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    """One streamed completion; its mean time between output tokens after the first."""
    body = {"model": "chat", "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return (times[-1] - times[0]) / (len(times) - 1)


async def _embedder(client: httpx.AsyncClient, url: str, doc: str, stop: asyncio.Event, done: list[int]) -> None:
    while not stop.is_set():
        r = await client.post(f"{url}/v1/embeddings", json={"model": "embedder", "input": doc})
        r.raise_for_status()
        done.append(r.json()["usage"]["prompt_tokens"])


async def _round(url: str, docs: list[str], max_tokens: int, with_embeddings: bool) -> tuple[float, float]:
    """Mean TPOT of the streams, and embedding tok/s meanwhile."""
    limits = httpx.Limits(max_connections=STREAMS + EMBED_CLIENTS + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop, done = asyncio.Event(), []
        start = time.perf_counter()
        embedders = [asyncio.create_task(_embedder(client, url, docs[i % len(docs)], stop, done))
                     for i in range(EMBED_CLIENTS if with_embeddings else 0)]
        tpots = await asyncio.gather(*(_stream(client, url, max_tokens) for _ in range(STREAMS)))
        elapsed = time.perf_counter() - start
        stop.set()
        await asyncio.gather(*embedders)
    return statistics.mean(tpots), sum(done) / elapsed


def main(args: argparse.Namespace) -> None:
    model_dir = Path(args.model) if args.model else default_model_dir()
    docs = texts_of_tokens(model_dir, EMBED_CLIENTS, args.doc_tokens)
    serve = ["--model", f"chat={args.beside_chat}", "--model", f"embedder={model_dir}", "--kv-cache-size", "1"]
    if args.encoder_threads:
        serve += ["--encoder-threads", str(args.encoder_threads)]
    if args.encoder_share:
        serve += ["--encoder-share", str(args.encoder_share)]
    log = Path(tempfile.mkdtemp()) / "server.log"
    proc, url = launch_server(serve, log)
    print(f"{args.beside_chat} decoding {STREAMS} streams x {args.output_len} tokens, beside {EMBED_CLIENTS} clients "
          f"embedding {args.doc_tokens}-token documents with {display_name(model_dir)} back to back; encoder threads "
          f"{args.encoder_threads or 'all'}, share {args.encoder_share or 'default'}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    try:
        asyncio.run(_round(url, docs, 8, True))  # warm-up
        alone, beside, rates = [], [], []
        for r in range(args.rounds):
            for with_embeddings in ((False, True) if r % 2 == 0 else (True, False)):
                tpot, rate = asyncio.run(_round(url, docs, args.output_len, with_embeddings))
                (beside if with_embeddings else alone).append(tpot)
                if with_embeddings:
                    rates.append(rate)
            print(f"round {r + 1}: TPOT alone {alone[-1] * 1e3:.1f} ms, beside embeddings {beside[-1] * 1e3:.1f} ms "
                  f"({beside[-1] / alone[-1]:.2f}x), embeddings {rates[-1]:.0f} tok/s", flush=True)
    finally:
        stop_server(proc)
    ratios = sorted(b / a for a, b in zip(alone, beside))
    print(f"TPOT alone {statistics.median(alone) * 1e3:.1f} ms, beside embeddings "
          f"{statistics.median(beside) * 1e3:.1f} ms: median ratio {statistics.median(ratios):.2f}x "
          f"(target <= 1.5x); embeddings meanwhile {statistics.median(rates):.0f} tok/s; "
          f"load average {os.getloadavg()[0]:.2f}")
