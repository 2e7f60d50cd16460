"""Prometheus metrics on a registry of the app's own (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvarn_requests", "Finished requests by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvarn_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("kvarn_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("kvarn_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("kvarn_request_latency_seconds", "Request latency from arrival to end",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("kvarn_requests_rejected", "Requests refused before admission (400: can never fit "
                                "the KV budget, 429: queue full)", ["status"], registry=r)
        for name, key, doc in (("kvarn_num_requests_running", "running", "Requests in the running batch"),
                               ("kvarn_num_requests_waiting", "waiting", "Requests waiting for admission"),
                               ("kvarn_kv_cache_bytes", "kv_bytes", "Bytes held by live KV caches"),
                               ("kvarn_kv_reserved_bytes", "reserved_bytes", "Bytes reserved by admitted requests"),
                               ("kvarn_kv_budget_bytes", "budget_bytes", "The KV budget admission works within")):
            Gauge(name, doc, registry=r).set_function(lambda key=key: stats().get(key, 0))
