"""Drive an OpenAI-compatible server with streaming completions and time every chunk."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from vinoserve.bench.metrics import RequestRecord
from vinoserve.bench.workloads import BenchRequest


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    timeout: float = 600.0
    temperature: float = 0.0  # greedy unless asked: the same tokens on every run
    top_p: float | None = None  # None: not sent (the server's default)
    top_k: int | None = None  # vLLM's extension; vinoserve honours it


async def send(client: httpx.AsyncClient, target: Target, req: BenchRequest, t0: float) -> RequestRecord:
    """One streaming request; never raises: failures are recorded with their reason."""
    body = {"model": target.model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": target.temperature, "stream": True, "stream_options": {"include_usage": True}}
    body.update({k: v for k, v in (("top_p", target.top_p), ("top_k", target.top_k)) if v is not None})
    if target.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; vinoserve and vLLM honour it
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    rec = RequestRecord(start=time.perf_counter() - t0, turn=req.turn)
    try:
        async with client.stream("POST", f"{target.base_url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:200]
                rec.error = f"HTTP {r.status_code}: {text}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return rec
                if chunk.get("choices"):
                    rec.chunk_times.append(time.perf_counter() - t0)
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                    rec.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rec.end = time.perf_counter() - t0
        if not rec.chunk_times:
            rec.error, rec.end = "no tokens streamed", None
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return rec


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int = 0) -> np.ndarray:
    """Gaps between request starts: gamma-distributed with mean 1/rate (burstiness 1 = Poisson,
    < 1 burstier, > 1 more regular); all zero for an infinite rate."""
    if rate == float("inf"):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


async def run(target: Target, requests: list[BenchRequest], rate: float = float("inf"), burstiness: float = 1.0,
              max_concurrency: int | None = None, on_done: Callable[[RequestRecord], None] | None = None,
              seed: int = 0) -> tuple[list[RequestRecord], float]:
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    gaps = arrival_gaps(len(requests), rate, burstiness, seed)
    # A fresh connection per request: servers that close idle keep-alive connections (llama.cpp's
    # does) would otherwise fail requests sent on a connection they just dropped.
    limits = httpx.Limits(max_connections=max_concurrency or max(len(requests), 1), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=target.timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> RequestRecord:
            async with limit:
                rec = await send(client, target, req, t0)
            if on_done:
                on_done(rec)
            return rec

        async def chat(turns: list[BenchRequest]) -> list[RequestRecord]:
            return [await one(req) for req in turns]

        # A conversation is one task sending its turns in order; its start takes one arrival gap.
        groups: dict[object, list[BenchRequest]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(i if req.conversation is None else ("c", req.conversation), []).append(req)
        tasks = []
        for turns, gap in zip(groups.values(), gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(chat(turns)))
        records = [rec for recs in await asyncio.gather(*tasks) for rec in recs]
    return records, time.perf_counter() - t0
