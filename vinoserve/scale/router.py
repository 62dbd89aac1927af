"""SGLang's router (sglang-router, the `scale` extra) as the supervisor starts and drives it.

Chosen by measurement over vLLM's router and Ray Serve (deploy/README.md): it forwards the
client's Authorization header to the replicas, which check it; its worker-management API is
locked behind a control-plane key that only the supervisor knows; and its cache-aware policy
keys a prefix tree on the request text, so it asks the replicas for nothing per request."""
from __future__ import annotations

import importlib.util
import json
import secrets
import sys
from dataclasses import dataclass, field

import httpx

POLICIES = {"cache-aware": "cache_aware", "round-robin": "round_robin", "power-of-two": "power_of_two",
            "random": "random"}
HEALTH_INTERVAL_S = 2
# sglang-router logs every step of a worker's registration at info; ours stays readable at warn.
_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}


def require_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("--replicas needs SGLang's router: pip install 'vinoserve[scale]'")


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server listening on host:port."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class Router:
    host: str
    port: int
    policy: str  # one of POLICIES
    metrics_port: int  # its own Prometheus endpoint, on loopback
    grace_s: float  # how long SIGTERM lets in-flight requests finish
    log_level: str = "info"
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @property
    def url(self) -> str:
        return local_url(self.host, self.port)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vinoserve.scale.child", "sglang_router.launch_router",
                "--host", self.host, "--port", str(self.port), "--policy", POLICIES[self.policy],
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--shutdown-grace-period-secs", str(max(1, round(self.grace_s))),
                "--log-level", _LOG_LEVELS[self.log_level]]

    def secret_env(self) -> dict[str, str]:
        return {"VINOSERVE_CHILD_SECRET_ARGS": json.dumps(
            ["--control-plane-api-keys", f"vinoserve:supervisor:admin:{self.admin_key}"])}

    def _admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def add_worker(self, url: str, model: str) -> str:
        """Registered by the served model's id, so the router's /v1/models names it; returns the
        router's id for it."""
        # A dead replica leaves the rotation within HEALTH_INTERVAL_S, a restarted one is back as fast
        # (the router's defaults, 60 s and 3 failures, suit pods rather than local processes).
        worker = {"url": url, "model_id": model, "health_check_interval_secs": HEALTH_INTERVAL_S,
                  "health_failure_threshold": 1, "health_success_threshold": 1, "health_check_timeout_secs": 5}
        r = httpx.post(f"{self.url}/workers", json=worker, headers=self._admin(), timeout=10)
        return r.raise_for_status().json()["worker_id"]

    def remove_worker(self, worker_id: str) -> None:
        """At once, rather than after the next failed health check: no request goes to a dead replica."""
        httpx.delete(f"{self.url}/workers/{worker_id}", headers=self._admin(), timeout=10).raise_for_status()

    def healthy_workers(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/readiness", timeout=2).json().get("healthy_workers")
        except (httpx.HTTPError, ValueError):
            return None
