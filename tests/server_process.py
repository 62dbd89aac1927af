"""A real `vinoserve serve` process on a free loopback port, for tests."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx

from vinoserve.bench.server_process import free_port, stop_server, wait_healthy


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, log_path: os.PathLike | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vinoserve.cli", "serve", "--port", str(self.port), *args]
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        if not wait_healthy(self.proc, self.url, timeout, poll=0.2):
            raise TimeoutError("server did not become healthy")
        return self

    def terminate(self, timeout: float = 60.0) -> int:
        code = stop_server(self.proc, timeout)
        self.log.close()
        return code


def sse_events(url: str, body: dict, timeout: float = 120) -> list[dict]:
    """The data of each server-sent event of a streamed POST (the Responses and Messages APIs
    name each event after its data's type: checked here)."""
    events, name = [], None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                assert events[-1]["type"] == name
    return events


def leave_stream(url: str, body: dict, event: str, count: int = 3) -> int:
    """Streams a POST and disconnects after `count` events named `event`; how many it saw."""
    seen = 0
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            seen += line == f"event: {event}"
            if seen == count:
                break
    return seen


def wait_idle(srv: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    """The running-request count and KV-cache usage once nothing runs (aborts land at the next
    engine step), or at the timeout."""
    def gauges() -> dict[str, float]:
        text = httpx.get(f"{srv.url}/metrics").text
        return {name: float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M).group(1))
                for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")}
    deadline = time.monotonic() + timeout
    while (now := gauges())["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return now
