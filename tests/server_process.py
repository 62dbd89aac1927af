"""A real `vinoserve serve` process on a free loopback port, for tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, log_path: os.PathLike | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vinoserve.cli", "serve", "--port", str(self.port), *args]
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
