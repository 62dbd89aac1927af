"""Starts the replicas and the router, restarts whichever dies, and stops them all on SIGTERM.

Each replica is a plain `vinoserve serve` on a loopback port, pinned to its share of the cores,
and so is the router; only the gate (scale/gate.py) listens on --host/--port, from the first
second: 503 with Retry-After until the router counts a healthy replica, then every connection
goes through to the router. A replica that dies after it has served is restarted on the same port
(the router checks health every second and takes it back); one that dies before it ever served
(a model that cannot load) stops everything with status 1."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from vinoserve.scale.gate import Gate
from vinoserve.scale.router import Router, local_url, require_router
from vinoserve.scale.topology import Share, shares_for

log = logging.getLogger("vinoserve.scale")
_POLL_S = 0.2  # how soon a dead child is noticed and taken out of the router
_KILL_AFTER_S = 10.0  # past the drain timeout, before SIGKILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0

    def start(self) -> None:
        # Its own session: a terminal's Ctrl-C reaches only the supervisor, which stops children
        # in order; PR_SET_PDEATHSIG (vinoserve.scale.child) ends them if the supervisor is killed.
        self.proc = subprocess.Popen(self.command, env={**os.environ, **self.env}, start_new_session=True)
        self.started = time.monotonic()

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def backoff_s(self) -> float:
        """Restart at once after a long run, slower each time a replica keeps dying young."""
        return 0.0 if time.monotonic() - self.started > 30 else min(30.0, 2.0 ** self.restarts)


@dataclass
class Replica(Child):
    port: int = 0
    share: Share | None = None
    threads: int = 0
    served: bool = False  # healthy once at least, and registered with the router
    worker_id: str | None = None  # the router's id for it while registered

    @property
    def url(self) -> str:
        return local_url("127.0.0.1", self.port)


def replica_command(argv: list[str], share: Share, port: int, threads: int) -> list[str]:
    """The user's own `serve` arguments, then the ones a replica must have: later flags win."""
    return [sys.executable, "-m", "vinoserve.scale.child", "--cpus", ",".join(map(str, share.cpus)),
            "vinoserve.cli", *argv, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
            "--replicas", "1"]


class Supervisor:
    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        require_router()
        self.api_key = args.api_key
        self.grace_s = args.shutdown_timeout
        self.stopping = False
        env = {"VINOSERVE_SUPERVISOR_PID": str(os.getpid()), "VINOSERVE_REPLICAS": "1"}
        self.replicas = []
        for share in shares_for(args.replicas):
            # --threads (or the container's VINOSERVE_THREADS) caps a replica; its share is the default.
            threads = share.threads if args.threads is None else min(args.threads, share.threads)
            port = free_port()
            self.replicas.append(Replica(replica_command(argv, share, port, threads), env, port=port, share=share,
                                         threads=threads))
        self.router = Router("127.0.0.1", free_port(), args.router_policy, free_port(), self.grace_s, args.log_level)
        self.router_proc = Child(self.router.command(), {**env, **self.router.secret_env()})
        self.gate = Gate(args.host, args.port, self.router.port)
        self.model: str | None = None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        try:
            self.gate.start()
        except OSError as e:
            log.error("cannot listen on %s: %s", local_url(self.gate.host, self.gate.port), e)
            return 1
        for r in self.replicas:
            r.start()
            log.info("replica %d: pid %d, cpus %s, %d threads, %s", self.replicas.index(r), r.proc.pid,
                     ",".join(map(str, r.share.cpus)), r.threads, r.url)
        self.router_proc.start()
        log.info("router: sglang-router (%s) on %s, its metrics on 127.0.0.1:%d; /readiness counts the "
                 "replicas serving; %s answers 503 until one is", self.router.policy, self.router.url,
                 self.router.metrics_port, local_url(self.gate.host, self.gate.port))
        try:
            while not self.stopping:
                time.sleep(_POLL_S)
                if not self.stopping and not self._tick():
                    return 1
            return 0
        finally:
            self._stop_all()

    def _stop(self, *_) -> None:
        # Only a flag: a signal handler that takes a lock can deadlock with the code it interrupts.
        self.stopping = True

    def _tick(self) -> bool:
        """One look at every child; False when the whole thing must stop."""
        if (status := self.router_proc.exited()) is not None:
            if not any(r.served for r in self.replicas):  # it never took a replica: a bad flag, a busy port
                log.error("the router exited with status %s before it served; stopping", status)
                return False
            log.warning("the router exited with status %s; restarting it", status)
            self.router_proc.start()
            for r in self.replicas:
                r.worker_id = None
        for i, r in enumerate(self.replicas):
            if (status := r.exited()) is not None:
                if not r.served:
                    log.error("replica %d exited with status %s before it served; stopping", i, status)
                    return False
                self._restart(i, r, status)
            elif r.worker_id is None:
                self._register(i, r)
        if not self.gate.ready and any(r.served for r in self.replicas) and self.router.healthy_workers():
            self.gate.ready = True
            log.info("serving on %s", local_url(self.gate.host, self.gate.port))
        return True

    def _restart(self, i: int, r: Replica, status: int) -> None:
        if r.worker_id is not None:
            try:
                self.router.remove_worker(r.worker_id)
                r.worker_id = None
            except httpx.HTTPError:
                pass  # its health check takes it out within seconds; try again next tick
        if r.restarts and time.monotonic() < r.started + r.backoff_s():
            return
        serving = sum(x.exited() is None for x in self.replicas)
        log.warning("replica %d exited with status %s; restarting it (%d of %d replicas left)", i, status,
                    serving, len(self.replicas))
        r.restarts += 1
        r.start()

    def _register(self, i: int, r: Replica) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            if httpx.get(f"{r.url}/health", timeout=2).status_code != 200:
                return
            if self.model is None:
                models = httpx.get(f"{r.url}/v1/models", headers=headers, timeout=5)
                self.model = models.raise_for_status().json()["data"][0]["id"]
            r.worker_id = self.router.add_worker(r.url, self.model)
        except httpx.HTTPError:
            return  # still loading, or the router is not up yet: the next tick tries again
        r.served = True
        log.info("replica %d is serving %s", i, self.model)

    def _stop_all(self) -> None:
        """SIGTERM to the router and every replica at once: each drains its in-flight requests
        (their replies still pass the gate, which takes no new connections)."""
        self.gate.stop_listening()
        children = [self.router_proc, *self.replicas]
        for c in children:
            if c.exited() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + _KILL_AFTER_S
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop within %.0f s; killing it", c.proc.pid, self.grace_s)
                c.proc.kill()
                c.proc.wait()


def run(args: argparse.Namespace, argv: list[str]) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
    return Supervisor(args, argv).run()
