"""A `vinoserve serve` in a child process for the benchmarks that measure a real server: started
on a free loopback port and waited for until healthy, its RSS read, stopped gracefully."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def launch_server(serve_args: list[str], log_file: Path, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(log_file, "w")
    proc = subprocess.Popen([sys.executable, "-m", "vinoserve.cli", "serve", "--port", str(port), *serve_args],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_file}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"the server was not healthy within {timeout:.0f} s; see {log_file}")


def stop_server(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
