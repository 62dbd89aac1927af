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
import re
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from vinoserve.bench.server_process import launch_server, memory_mib, stop_server
from vinoserve.bench.soak_client import Soak, SoakConfig

__all__ = ["SoakConfig", "launch_server", "run_soak", "stop_server"]

# Log lines that mean something went wrong server-side (a client leaving is not one).
LOG_ERRORS = re.compile(r"Traceback|never retrieved|Exception in ASGI| ERROR | CRITICAL ")


def _metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{", 1)[0]] = float(value)
    return out


def run_soak(base_url: str, model: str, config: SoakConfig, pid: int | None = None,
             log_path: Path | None = None, api_key: str | None = None, progress=None,
             embedder: str | None = None) -> dict:
    """`embedder`: a served embedding model's name, to send a share of /v1/embeddings requests to."""
    soak = Soak(base_url, model, config, api_key, embedder)
    samples: list[dict] = []

    async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
        return _metrics((await client.get(f"{soak.url}/metrics")).text)

    async def main() -> tuple[float, dict, dict]:
        async with httpx.AsyncClient(timeout=30) as client:
            before = await scrape(client)

            async def sample(t: float) -> None:
                m = await scrape(client)
                mem = memory_mib(pid, ("VmRSS", "RssAnon")) if pid else {}
                samples.append({"t_s": round(t, 1), "done": soak.tally.done, "rss_mb": mem.get("VmRSS"),
                                "rss_anon_mb": mem.get("RssAnon"),
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
    result["rss_growth"] = rss_growth(result["rss_mb"], config.num_requests)
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
    if r["rss_growth"] is not None and r["rss_growth"] > r["config"]["max_rss_growth"]:
        out.append(f"anonymous resident memory grew {100 * r['rss_growth']:.1f}% from the end of the first tenth "
                   f"of the requests to the last tenth")
    if r["requests_done"] < r["config"]["num_requests"]:
        out.append(f"only {r['requests_done']} of {r['config']['num_requests']} requests ran within the time limit")
    return out


def rss_growth(rss: list[dict], num_requests: int) -> float | None:
    """Anonymous resident memory's growth (what the server allocated: mapped files' pages come and
    go with the host's page cache) from the end of the first tenth of the requests to the last
    tenth's peak: a per-request leak grows it, while the KV cache's first touches (the allocator
    walks every block once; docs/reliability.md) are done early in a run of thousands."""
    first = [s["rss_anon_mb"] for s in rss if s["done"] <= num_requests / 10]
    last = [s["rss_anon_mb"] for s in rss if s["done"] >= num_requests * 0.9]
    return max(last) / first[-1] - 1 if first and last else None


def report(r: dict) -> str:
    lines = [f"requests: {r['requests_done']} in {r['duration_s']} s; statuses {r['statuses']}",
             f"kinds: {r['kinds']}", f"disconnects: {r['disconnects']}",
             f"tokens: delivered {r['delivered_tokens']}, generated for nobody {r['undelivered_tokens']:.0f} "
             f"({r['undelivered_per_disconnect']:.2f} per disconnect)",
             f"after: {r['still_running']:.0f} running/waiting, KV usage {100 * r['kv_usage_after']:.1f}%"]
    if r["rss_growth"] is not None:
        lines.append(f"anonymous RSS growth, first tenth's end to last tenth's peak: {100 * r['rss_growth']:+.1f}%")
    rss = r["rss_mb"]
    if rss:
        picks = rss[:: max(1, len(rss) // 10)] + [rss[-1]]
        lines.append("RSS / anonymous (MB) over time: " + ", ".join(
            f"{s['t_s']:.0f}s/{s['done']}req: {s['rss_mb']:.0f}/{s['rss_anon_mb']:.0f}" for s in picks))
    lines += [f"FAIL: {f}" for f in r["failures"]] or ["PASS"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    p.add_argument("--base-url", default=None, help="drive this running server (default: launch one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: its process, for RSS")
    p.add_argument("--server-log", type=Path, default=None, help="with --base-url: its log, for errors")
    p.add_argument("--serve-args", default="", help="flags for the launched `vinoserve serve`, one string; "
                   "with an embedder beside the chat model (--model CHAT --model NAME=DIR), a share of the "
                   "requests are embeddings")
    p.add_argument("--model", default=None, help="the model id to send (default: what /v1/models lists)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--stream-share", type=float, default=d.stream_share)
    p.add_argument("--disconnect-share", type=float, default=d.disconnect_share)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-rss-growth", type=float, default=d.max_rss_growth,
                   help="fail when anonymous resident memory grows more than this share from the end of the "
                        "first tenth of the requests to the last tenth (default: 0.05)")
    p.add_argument("--disconnect-max-tokens", type=int, default=d.disconnect_max_tokens)
    p.add_argument("--time-limit", type=float, default=d.time_limit_s, metavar="S")
    p.add_argument("--sample-every", type=float, default=d.sample_every_s, metavar="S")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--save-result", type=Path, default=None)
    p.add_argument("--log-file", type=Path, default=Path("soak-server.log"), help="the launched server's log")


def main(args: argparse.Namespace) -> int:
    config = SoakConfig(args.num_requests, args.concurrency, args.stream_share, args.disconnect_share,
                        max_tokens=args.max_tokens, disconnect_max_tokens=args.disconnect_max_tokens,
                        max_rss_growth=args.max_rss_growth,
                        time_limit_s=args.time_limit, sample_every_s=args.sample_every, seed=args.seed)
    proc, log = None, args.server_log
    url, pid = args.base_url, args.server_pid
    if url is None:
        proc, url = launch_server(shlex.split(args.serve_args), args.log_file)
        pid, log = proc.pid, args.log_file
    try:
        model, embedder = _served(url, args.api_key)
        result = run_soak(url, args.model or model, config, pid, log, args.api_key,
                          progress=lambda s: print(f"  {s}", file=sys.stderr, flush=True), embedder=embedder)
    finally:
        if proc is not None:
            stop_server(proc)
    print(report(result))
    if args.save_result:
        args.save_result.write_text(json.dumps(result, indent=2))
    return 1 if result["failures"] else 0


def _served(url: str, api_key: str | None) -> tuple[str, str | None]:
    """The chat model's name, and an embedder's if one is served beside it."""
    cards = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}).json()
    chat = next(c["id"] for c in cards["data"] if "chat" in c.get("tasks", ["chat"]))
    return chat, next((c["id"] for c in cards["data"] if "embeddings" in c.get("tasks", ())), None)
