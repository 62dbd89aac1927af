"""`vinoserve bench soak`: many mixed requests with clients leaving at random points, then checks
that the server is as it was: no 5xx, no request still running, no KV block held, no abort that
failed to land (tokens generated for nobody), no traceback in its log, and RSS over time.

By default it launches `vinoserve serve` itself (so it can read the process's RSS and log);
with --base-url it drives a server that is already running (RSS and log checks then need
--server-pid and --server-log)."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from vinoserve.bench.server_process import launch_server, memory_mib, stop_server
from vinoserve.bench.workloads import _english_words

# A disconnect is one of these, chosen uniformly.
DISCONNECTS = ("before-first-token", "mid-stream", "non-stream-wait")
# Log lines that mean something went wrong server-side (a client leaving is not one).
LOG_ERRORS = re.compile(r"Traceback|never retrieved|Exception in ASGI| ERROR | CRITICAL ")


@dataclass
class SoakConfig:
    num_requests: int = 500
    concurrency: int = 48
    stream_share: float = 0.7
    disconnect_share: float = 0.2
    invalid_share: float = 0.03  # requests that must be answered 400
    max_tokens: int = 64  # requests that stay get 1..max_tokens
    disconnect_max_tokens: int = 1500  # large, so a missed abort shows as tokens generated for nobody
    max_undelivered_per_disconnect: float = 4.0
    time_limit_s: float = 3600.0
    settle_s: float = 10.0  # after the last request, how long aborts may take to land
    sample_every_s: float = 2.0
    seed: int = 0


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    disconnects: Counter = field(default_factory=Counter)
    delivered_tokens: int = 0
    disconnected_streams: int = 0  # engine requests whose client left (a multi-prompt request has several)
    client_errors: list[str] = field(default_factory=list)  # unexpected client-side failures
    done: int = 0


def _metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{", 1)[0]] = float(value)
    return out


class Soak:
    def __init__(self, base_url: str, model: str, config: SoakConfig, api_key: str | None = None) -> None:
        self.url, self.model, self.c = base_url.rstrip("/"), model, config
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.rng = random.Random(config.seed)
        self.words = _english_words()
        self.tally = Tally()

    def _prompt(self) -> str:
        return " ".join(self.rng.choices(self.words, k=self.rng.randint(4, 120)))

    def _body(self, chat: bool, stream: bool, leave: bool) -> dict:
        max_tokens = self.c.disconnect_max_tokens if leave else self.rng.randint(1, self.c.max_tokens)
        body = {"model": self.model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": leave,
                "temperature": self.rng.choice((0.0, 0.8))}
        if chat:
            body["messages"] = [{"role": "user", "content": self._prompt()}]
            if self.rng.random() < 0.2:
                body.update(logprobs=True, top_logprobs=2)
        else:
            prompts = [self._prompt() for _ in range(self.rng.choice((1, 1, 1, 2, 3)))]
            body["prompt"] = prompts[0] if len(prompts) == 1 else prompts
            if self.rng.random() < 0.2:
                body["logprobs"] = 2
        if stream and self.rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if self.rng.random() < 0.1:
            body["stop"] = ["\n\n", " the"]
        return body

    def _invalid(self) -> tuple[str, dict]:
        return self.rng.choice((
            ("/v1/chat/completions", {"model": self.model, "messages": []}),
            ("/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": -1}),
            ("/v1/completions", {"model": self.model, "prompt": []}),
            ("/v1/chat/completions", {"model": self.model, "messages": [{"role": "user", "content": "x"}],
                                      "temperature": -1}),
        ))

    async def one(self, client: httpx.AsyncClient) -> None:
        r = self.rng.random()
        if r < self.c.invalid_share:
            path, body = self._invalid()
            resp = await client.post(self.url + path, json=body, headers=self.headers)
            self.tally.kinds["invalid"] += 1
            self._status(resp.status_code, expect=400)
            return
        if r < self.c.invalid_share + 0.03:
            await self._light(client)
            return
        chat, stream = self.rng.random() < 0.5, self.rng.random() < self.c.stream_share
        leave = self.rng.random() < self.c.disconnect_share
        how = self.rng.choice(DISCONNECTS[:2] if stream else DISCONNECTS[2:] + DISCONNECTS[:1]) if leave else None
        body = self._body(chat, stream, leave)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        self.tally.kinds[f"{'chat' if chat else 'completion'}-{'stream' if stream else 'plain'}"] += 1
        if how is not None:
            self.tally.disconnects[how] += 1
            self.tally.disconnected_streams += 1 if chat or isinstance(body["prompt"], str) else len(body["prompt"])
        if stream:
            await self._stream(client, path, body, chat, how)
        else:
            await self._plain(client, path, body, how)

    async def _light(self, client: httpx.AsyncClient) -> None:
        path, body = self.rng.choice((("/v1/models", None), ("/tokenize", {"prompt": self._prompt()}),
                                      ("/detokenize", {"tokens": [1, 2, 3]}), ("/health", None)))
        self.tally.kinds["light"] += 1
        if body is None:
            resp = await client.get(self.url + path, headers=self.headers)
        else:
            resp = await client.post(self.url + path, json=body, headers=self.headers)
        self._status(resp.status_code, expect=200)

    async def _plain(self, client: httpx.AsyncClient, path: str, body: dict, how: str | None) -> None:
        if how is not None:
            # Leave while the server is still generating: before it starts, or some way in.
            wait = self.rng.uniform(0.0, 0.05) if how == "before-first-token" else self.rng.uniform(0.1, 2.0)
            try:
                resp = await asyncio.wait_for(client.post(self.url + path, json=body, headers=self.headers), wait)
            except asyncio.TimeoutError:
                return
            self._status(resp.status_code, expect=200)  # it finished before we left
            if resp.status_code == 200:
                self.tally.delivered_tokens += resp.json()["usage"]["completion_tokens"]
            return
        resp = await client.post(self.url + path, json=body, headers=self.headers)
        if self._status(resp.status_code, expect=200):
            data = resp.json()
            self.tally.delivered_tokens += data["usage"]["completion_tokens"]
            if any(c["finish_reason"] not in ("stop", "length") for c in data["choices"]):
                self.tally.client_errors.append(f"finish_reason: {data['choices']}")

    async def _stream(self, client: httpx.AsyncClient, path: str, body: dict, chat: bool, how: str | None) -> None:
        leave_after = 0 if how == "before-first-token" else self.rng.randint(1, 40) if how else None
        tokens, finished = 0, 0
        async with client.stream("POST", self.url + path, json=body, headers=self.headers) as resp:
            if not self._status(resp.status_code, expect=200):
                await resp.aread()
                return
            if leave_after == 0:
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.tally.client_errors.append(f"stream error: {chunk['error']}")
                    self.tally.statuses["stream-error"] += 1
                    return
                for choice in chunk.get("choices", []):
                    if chat and "role" in choice["delta"]:
                        continue
                    tokens += 1
                    self.tally.delivered_tokens += 1
                    finished += choice["finish_reason"] is not None
                if leave_after is not None and tokens >= leave_after:
                    return  # leaving the block closes the connection mid-stream
        expected = 1 if chat or isinstance(body["prompt"], str) else len(body["prompt"])
        if how is None and finished != expected:
            self.tally.client_errors.append(f"stream ended with {finished} of {expected} choices finished")

    def _status(self, status: int, expect: int) -> bool:
        self.tally.statuses[status] += 1
        if status != expect and not 400 <= status < 500:
            self.tally.client_errors.append(f"HTTP {status} where {expect} was expected")
        elif status != expect and expect == 400:
            self.tally.client_errors.append(f"HTTP {status} for an invalid request")
        return status == expect

    async def run(self, sample) -> float:
        """All requests, `concurrency` at a time; `sample()` is called every sample_every_s."""
        limits = httpx.Limits(max_connections=self.c.concurrency, max_keepalive_connections=0)
        start = time.monotonic()
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(self.c.num_requests):
                queue.put_nowait(i)

            async def worker() -> None:
                while not queue.empty() and time.monotonic() - start < self.c.time_limit_s:
                    queue.get_nowait()
                    try:
                        await self.one(client)
                    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                        self.tally.client_errors.append(f"{type(e).__name__}: {e}")
                    self.tally.done += 1

            async def sampler() -> None:
                while True:
                    await sample(time.monotonic() - start)
                    await asyncio.sleep(self.c.sample_every_s)

            probe = asyncio.create_task(sampler())
            await asyncio.gather(*(worker() for _ in range(self.c.concurrency)))
            probe.cancel()
        return time.monotonic() - start


def run_soak(base_url: str, model: str, config: SoakConfig, pid: int | None = None,
             log_path: Path | None = None, api_key: str | None = None, progress=None) -> dict:
    soak = Soak(base_url, model, config, api_key)
    samples: list[dict] = []

    async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
        return _metrics((await client.get(f"{soak.url}/metrics")).text)

    async def main() -> tuple[float, dict, dict]:
        async with httpx.AsyncClient(timeout=30) as client:
            before = await scrape(client)

            async def sample(t: float) -> None:
                m = await scrape(client)
                rss = memory_mib(pid).get("VmRSS") if pid else None
                samples.append({"t_s": round(t, 1), "done": soak.tally.done, "rss_mb": rss,
                                "running": m.get("vllm:num_requests_running"),
                                "kv_usage": m.get("vllm:kv_cache_usage_perc")})
                if progress:
                    progress(samples[-1])

            duration = await soak.run(sample)
            deadline = time.monotonic() + config.settle_s
            while True:  # aborts land at the next step boundary; give them a moment
                after = await scrape(client)
                idle = not after.get("vllm:num_requests_running") and not after.get("vllm:num_requests_waiting")
                if (idle and not after.get("vllm:kv_cache_usage_perc")) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            await sample(duration + config.settle_s if not idle else duration)
        return duration, before, after

    duration, before, after = asyncio.run(main())
    t = soak.tally

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    undelivered = delta("vinoserve:undelivered_tokens_total")
    log_errors = []
    if log_path is not None and log_path.exists():
        log_errors = [line for line in log_path.read_text(errors="replace").splitlines() if LOG_ERRORS.search(line)]
    result = {
        "config": asdict(config), "duration_s": round(duration, 1), "requests_done": t.done,
        "statuses": {str(k): v for k, v in sorted(t.statuses.items(), key=lambda kv: str(kv[0]))},
        "kinds": dict(t.kinds), "disconnects": dict(t.disconnects),
        "delivered_tokens": t.delivered_tokens,
        "server_generated_tokens": delta("vllm:generation_tokens_total"),
        "undelivered_tokens": undelivered,
        "undelivered_per_disconnect": undelivered / max(1, t.disconnected_streams),
        "still_running": after.get("vllm:num_requests_running", 0.0) + after.get("vllm:num_requests_waiting", 0.0),
        "kv_usage_after": after.get("vllm:kv_cache_usage_perc", 0.0),
        "server_5xx": sum(v for k, v in t.statuses.items() if isinstance(k, int) and k >= 500),
        "client_errors": t.client_errors[:20], "num_client_errors": len(t.client_errors),
        "log_errors": log_errors[:20], "num_log_errors": len(log_errors),
        "rss_mb": [s for s in samples if s["rss_mb"] is not None], "samples": samples,
    }
    result["failures"] = failures(result)
    return result


def failures(r: dict) -> list[str]:
    out = []
    if r["server_5xx"]:
        out.append(f"{r['server_5xx']} responses were 5xx")
    if r["statuses"].get("stream-error"):
        out.append(f"{r['statuses']['stream-error']} streams ended in an error event")
    if r["num_client_errors"]:
        out.append(f"{r['num_client_errors']} unexpected client-side results, e.g. {r['client_errors'][0]}")
    if r["still_running"]:
        out.append(f"{r['still_running']:.0f} requests still running or waiting after the run")
    if r["kv_usage_after"]:
        out.append(f"KV cache {100 * r['kv_usage_after']:.1f}% in use after the run (leaked blocks)")
    if r["undelivered_per_disconnect"] > r["config"]["max_undelivered_per_disconnect"]:
        out.append(f"{r['undelivered_tokens']:.0f} tokens generated after their client left "
                   f"({r['undelivered_per_disconnect']:.1f} per disconnect): an abort did not land")
    if r["num_log_errors"]:
        out.append(f"{r['num_log_errors']} error lines in the server log, e.g. {r['log_errors'][0]}")
    if r["requests_done"] < r["config"]["num_requests"]:
        out.append(f"only {r['requests_done']} of {r['config']['num_requests']} requests ran within the time limit")
    return out


def report(r: dict) -> str:
    lines = [f"requests: {r['requests_done']} in {r['duration_s']} s; statuses {r['statuses']}",
             f"kinds: {r['kinds']}", f"disconnects: {r['disconnects']}",
             f"tokens: delivered {r['delivered_tokens']}, generated for nobody {r['undelivered_tokens']:.0f} "
             f"({r['undelivered_per_disconnect']:.2f} per disconnect)",
             f"after: {r['still_running']:.0f} running/waiting, KV usage {100 * r['kv_usage_after']:.1f}%"]
    rss = r["rss_mb"]
    if rss:
        picks = rss[:: max(1, len(rss) // 10)] + [rss[-1]]
        lines.append("RSS (MB) over time: " + ", ".join(f"{s['t_s']:.0f}s/{s['done']}req: {s['rss_mb']:.0f}"
                                                        for s in picks))
    lines += [f"FAIL: {f}" for f in r["failures"]] or ["PASS"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    p.add_argument("--base-url", default=None, help="drive this running server (default: launch one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: its process, for RSS")
    p.add_argument("--server-log", type=Path, default=None, help="with --base-url: its log, for errors")
    p.add_argument("--serve-args", default="", help="flags for the launched `vinoserve serve`, one string")
    p.add_argument("--model", default=None, help="the model id to send (default: what /v1/models lists)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--stream-share", type=float, default=d.stream_share)
    p.add_argument("--disconnect-share", type=float, default=d.disconnect_share)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--disconnect-max-tokens", type=int, default=d.disconnect_max_tokens)
    p.add_argument("--time-limit", type=float, default=d.time_limit_s, metavar="S")
    p.add_argument("--sample-every", type=float, default=d.sample_every_s, metavar="S")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--save-result", type=Path, default=None)
    p.add_argument("--log-file", type=Path, default=Path("soak-server.log"), help="the launched server's log")


def main(args: argparse.Namespace) -> int:
    config = SoakConfig(args.num_requests, args.concurrency, args.stream_share, args.disconnect_share,
                        max_tokens=args.max_tokens, disconnect_max_tokens=args.disconnect_max_tokens,
                        time_limit_s=args.time_limit, sample_every_s=args.sample_every, seed=args.seed)
    proc, log = None, args.server_log
    url, pid = args.base_url, args.server_pid
    if url is None:
        proc, url = launch_server(shlex.split(args.serve_args), args.log_file)
        pid, log = proc.pid, args.log_file
    try:
        model = args.model or httpx.get(f"{url}/v1/models", headers=_auth(args.api_key)).json()["data"][0]["id"]
        result = run_soak(url, model, config, pid, log, args.api_key,
                          progress=lambda s: print(f"  {s}", file=sys.stderr, flush=True))
    finally:
        if proc is not None:
            stop_server(proc)
    print(report(result))
    if args.save_result:
        args.save_result.write_text(json.dumps(result, indent=2))
    return 1 if result["failures"] else 0


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}
