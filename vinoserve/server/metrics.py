"""Prometheus metrics under vLLM's names, so existing dashboards and autoscalers work unchanged."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vinoserve.engine.async_engine import AsyncLLMEngine
from vinoserve.engine.outputs import RequestMetrics

disable_created_metrics()  # the *_created series only add noise to every scrape

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)


class _EngineGauges:
    """Read at scrape time from what the engine thread publishes after each step."""

    def __init__(self, engine: AsyncLLMEngine, model: str) -> None:
        self.engine, self.model = engine, model

    def collect(self):
        stats = self.engine.stats
        spec = stats.spec_decode
        for family, name, doc, value in [
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
             stats.num_waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             stats.kv_cache_usage),
            (CounterMetricFamily, "vllm:num_preemptions", "Preemptions by recompute.", stats.num_preemptions),
            (CounterMetricFamily, "vinoserve:evicted_blocks", "KV blocks evicted by the cache-eviction policy.",
             stats.num_evicted_blocks),
            (CounterMetricFamily, "vinoserve:rotated_blocks", "KV blocks re-rotated after eviction.",
             stats.num_rotated_blocks),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            (CounterMetricFamily, "vinoserve:undelivered_tokens",
             "Tokens generated after their client had left (an abort lands at the next step).",
             stats.num_undelivered_tokens),
        ] + ([] if spec is None else [
            (CounterMetricFamily, "vllm:spec_decode_num_drafts",
             "Verifications of proposed tokens (one per sequence and step).", spec.num_drafts),
            (CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Tokens proposed.", spec.num_draft_tokens),
            (CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
             spec.num_accepted_tokens),
        ]):
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric([self.model], value)
            yield metric
        yield from self._model_server_protocol()
        if spec is None:
            return
        metric = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Proposed tokens accepted, by position.", labels=["model_name", "position"])
        for pos, value in enumerate(spec.accepted_per_position):
            metric.add_metric([self.model, str(pos)], value)
        yield metric


    def _model_server_protocol(self):
        """The two info series of the model server protocol that the Gateway API Inference
        Extension's endpoint pickers read besides the gauges above: the KV block size (the prefix
        scorer aligns its hashes to it) and LoRA state (no adapters here)."""
        blocks = self.engine.engine.blocks
        cache = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration, in the labels.",
                                  labels=["block_size", "num_gpu_blocks"])
        cache.add_metric([str(blocks.block_size), str(blocks.num_blocks)], 1)
        yield cache
        # vLLM's value is when the series was set; pickers keep the series with the largest.
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests (no adapters).",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric(["0", "", ""], time.time())
        yield lora


class Metrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        r, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled step.", labels,
                               buckets=_LATENCY, registry=r)
        for m in (self.prompt_tokens, self.generation_tokens):
            m.labels(model).inc(0)  # export zeros before the first request

    def watch(self, engine: AsyncLLMEngine) -> None:
        self.registry.register(_EngineGauges(engine, self.model))

    def token(self, gap_seconds: float | None) -> None:
        self.generation_tokens.labels(self.model).inc()
        if gap_seconds is not None:
            self.itl.labels(self.model).observe(gap_seconds)

    def prefilled(self, prompt_tokens: int, m: RequestMetrics | None) -> None:
        """At a request's first token, so a long generation shows its prompt (and TTFT) at once.
        Like vLLM, a prompt recomputed after preemption is not counted again."""
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.labels(self.model).observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.labels(self.model).observe(m.first_scheduled_time - m.arrival_time)

    def finished(self, m: RequestMetrics) -> None:
        if m.finished_time is not None:
            self.e2e.labels(self.model).observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
