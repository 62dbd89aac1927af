"""Serving metrics from per-request timestamps: the arithmetic, separate from the I/O."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds from the benchmark's start."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed token chunk
    end: float | None = None
    prompt_tokens: int = 0  # from the server's usage
    output_tokens: int = 0
    error: str | None = None
    turn: int = 0  # multi-turn workloads: 0 for a conversation's first request
    cached_tokens: int = 0  # prompt tokens the server reports it found in its prefix cache

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Goodput:
    """SLOs in milliseconds; a request counts toward goodput if it meets every one given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, spec: str | None) -> Goodput | None:
        if not spec:
            return None
        names = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}
        values = {}
        for part in spec.split(","):
            key, _, value = part.partition(":")
            if key not in names:
                raise ValueError(f"goodput SLO {key!r}: use ttft, tpot or e2el, e.g. ttft:500,tpot:50")
            values[names[key]] = float(value)
        return cls(**values)

    def met(self, r: RequestRecord) -> bool:
        checks = [(self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot if r.tpot is not None else 0.0),
                  (self.e2el_ms, r.e2e)]
        return all(limit is None or value * 1000 <= limit for limit, value in checks)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values, dtype=np.float64) * 1000  # milliseconds
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(records: list[RequestRecord], duration: float, goodput: Goodput | None = None) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error}),
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_token_throughput": sum(r.prompt_tokens for r in ok) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok if r.chunk_times]),
        "tpot_ms": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itls]),
        "e2el_ms": percentiles([r.e2e for r in ok]),
    }
    follow_ups = [r for r in ok if r.turn > 0 and r.chunk_times]
    if follow_ups:  # multi-turn: the turns that a prefix cache can speed up
        summary["ttft_first_turn_ms"] = percentiles([r.ttft for r in ok if r.turn == 0 and r.chunk_times])
        summary["ttft_follow_up_ms"] = percentiles([r.ttft for r in follow_ups])
    summary["total_cached_tokens"] = sum(r.cached_tokens for r in ok)
    if goodput is not None:
        good = [r for r in ok if r.chunk_times and goodput.met(r)]
        summary["goodput"] = len(good) / duration if duration else 0.0
    return summary
