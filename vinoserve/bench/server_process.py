"""A server in a child process for the benchmarks (and tests) that measure a real one: a free
loopback port, waiting until its /health answers, its memory read from /proc, a graceful stop."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, poll: float = 0.5) -> bool:
    """Until `url`/health answers 200 (True) or `timeout` passes (False); RuntimeError if the
    process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(poll)
    return False


def launch_server(serve_args: list[str], log_file: Path, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`vinoserve serve` with these flags, its output in `log_file`, once healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vinoserve.cli", "serve", "--port", str(port), *serve_args],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        healthy = wait_healthy(proc, url, timeout)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; see {log_file}") from None
    if not healthy:
        stop_server(proc)
        raise TimeoutError(f"the server was not healthy within {timeout:.0f} s; see {log_file}")
    return proc, url


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM (a graceful drain), SIGKILL if it is not gone within `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def memory_mib(pid: int, keys: tuple[str, ...] = ("VmRSS",)) -> dict[str, int]:
    """Fields of /proc/PID/status in MiB (VmRSS, RssAnon, RssFile); empty once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines if ":" in line)
    return {key: int(value.split()[0]) // 1024 for key, value in fields if key in keys}
