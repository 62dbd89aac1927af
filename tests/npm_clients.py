"""Real agent clients from npm (Codex CLI, Claude Code), pinned, installed on first use into a cache
directory outside the repository, and a recording proxy that shows what they send and get.

`npm install` runs once per pinned version (a lock file keeps two test processes from doing it at
once); later runs find the binary in the cache. Both packages ship a native binary in an optional
per-platform dependency, so Node.js's own version does not matter. Without npm the tests skip,
unless VINOSERVE_REQUIRE_NPM=1 (as .ci/run sets) makes that a failure.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from platformdirs import user_cache_dir

CODEX = ("@openai/codex", "0.169.0", "codex")
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.328", "claude")


def npm_client(package: str, version: str, binary: str) -> Path:
    """The binary of `package@version`, installed into the cache if it is not there yet."""
    npm = shutil.which("npm")
    if npm is None:
        if os.environ.get("VINOSERVE_REQUIRE_NPM"):
            pytest.fail("npm is not installed (the agent-client tests need it)")
        pytest.skip("npm is not installed")
    root = Path(os.environ.get("VINOSERVE_NPM_CACHE") or user_cache_dir("vinoserve-tests")) / "npm"
    prefix = root / f"{package.replace('/', '+')}@{version}"
    exe = prefix / "node_modules" / ".bin" / binary
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            r = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
                                f"{package}@{version}"], capture_output=True, text=True, timeout=900)
            assert r.returncode == 0 and exe.exists(), f"npm install {package}@{version} failed:\n{r.stderr[-3000:]}"
    return exe


@dataclass
class Exchange:
    method: str
    path: str  # with its query
    body: dict | None
    status: int
    reply: bytes  # the whole reply body (a stream's events as sent)

    def events(self) -> list[dict]:
        """The data of each server-sent event of a streamed reply."""
        return [json.loads(line[6:]) for line in self.reply.decode().splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]


@dataclass
class RecordingProxy:
    """Forwards every request to `upstream` as it is, streaming replies back as they come, and
    keeps each exchange (request body, status, reply body) for the test to read."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)

    def __enter__(self) -> RecordingProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                data = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                with httpx.Client(timeout=600) as client, client.stream(
                        self.command, proxy.upstream + self.path, content=data, headers=headers) as r:
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    reply = b""
                    for chunk in r.iter_raw():
                        reply += chunk
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                body = json.loads(data) if data and self.headers.get("content-type", "").startswith(
                    "application/json") else None
                proxy.exchanges.append(Exchange(self.command, self.path, body, r.status_code, reply))

            do_GET = do_POST = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
