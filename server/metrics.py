"""Prometheus metrics on a registry of the app's own (no process-global state).

Besides kvarn's own (``kvarn_*``), the names routers and dashboards scrape from vLLM, labelled
``model_name`` as vLLM labels them (``VllmCollector``): llm-d's and the Gateway API inference
extension's load-aware scorers read ``vllm:num_requests_waiting``, ``vllm:num_requests_running``
and ``vllm:kv_cache_usage_perc`` (older ones ``vllm:gpu_cache_usage_perc``), and vLLM's Grafana
dashboard the prefix cache's ``vllm:prefix_cache_{queries,hits}_total`` (in tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# The prefix cache's own numbers, read from EngineClient.stats() at each scrape: counters the
# engine keeps monotonic (exposed with a ``_total`` suffix) and gauges. A missing key reads 0.
PREFIX_CACHE_COUNTERS = (
    ("kvarn_prefix_cache_lookups", "apc_lookups", "Prefix cache lookups of prompts"),
    ("kvarn_prefix_cache_query_tokens", "apc_query_tokens", "Prompt tokens looked up in the prefix cache"),
    ("kvarn_prefix_cache_hit_tokens", "apc_hit_tokens", "Prompt tokens served from the prefix cache"),
    ("kvarn_prefix_cache_inserted_blocks", "apc_inserted_blocks", "Blocks inserted into the prefix cache"),
    ("kvarn_prefix_cache_evicted_blocks", "apc_evicted_blocks", "Blocks evicted from the prefix cache's memory "
                                                                "tier to stay within its byte budget"),
    ("kvarn_prefix_cache_disk_errors", "apc_disk_errors", "Disk tier errors (a bad or unreadable block file is a "
                                                          "miss, removed and counted here)"),
)
# The engine's prompt forwards, from the same stats: how many forwards ran prompt chunks and how
# many chunks they ran (chunks over forwards is how many rows' chunks a forward batched on average).
ENGINE_COUNTERS = (
    ("kvarn_prefill_forwards", "prefill_forwards", "Forwards that ran prompt chunks (one forward runs the chunks "
                                                   "of one or more rows together)"),
    ("kvarn_prefill_chunks", "prefill_chunks", "Prompt chunks run"),
    ("kvarn_spec_decode_draft_tokens", "spec_draft_tokens", "Drafted tokens verified by speculative decoding"),
    ("kvarn_spec_decode_accepted_tokens", "spec_accepted_tokens", "Drafted tokens the target model accepted"),
    ("kvarn_spec_decode_verifies", "spec_verifies", "Verifies run (a row's drafts checked in one step)"),
)
PREFIX_CACHE_GAUGES = (
    ("kvarn_prefix_cache_memory_bytes", "apc_memory_bytes", "Bytes held by the prefix cache's memory tier"),
    ("kvarn_prefix_cache_memory_budget_bytes", "apc_memory_budget_bytes",
     "The most the prefix cache may keep in memory (its cap, else the KV budget it shares with running requests)"),
    ("kvarn_prefix_cache_disk_bytes", "apc_disk_bytes", "Bytes held by the prefix cache's disk tier"),
)


class StatsCollector(Collector):
    """The prefix cache's counters and gauges and the engine's prompt forward counters, from one
    ``stats()`` call per scrape."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        return self._families(self._stats())

    @staticmethod
    def _families(stats: dict[str, int]) -> Iterator[Metric]:
        for name, key, doc in (*PREFIX_CACHE_COUNTERS, *ENGINE_COUNTERS):
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        for name, key, doc in PREFIX_CACHE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0))


class VllmCollector(Collector):
    """vLLM's metric names, from one ``stats()`` call per scrape, once a model is loaded
    (``model_name()`` None: nothing yet). KV cache usage is the share of the KV budget that
    running and admitted requests hold or may still take (0 to 1, as vLLM's)."""

    def __init__(self, stats: Callable[[], dict[str, int]], model_name: Callable[[], str | None]) -> None:
        self._stats, self._model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        name = self._model_name()
        if name is None:
            return
        stats = self._stats()
        budget = stats.get("budget_bytes", 0)
        usage = min(stats.get("reserved_bytes", 0) / budget, 1.0) if budget else 0.0
        gauges = (("vllm:num_requests_running", "Requests in the running batch", stats.get("running", 0)),
                  ("vllm:num_requests_waiting", "Requests waiting for admission", stats.get("waiting", 0)),
                  ("vllm:kv_cache_usage_perc", "KV cache usage (1 = the whole KV budget)", usage),
                  ("vllm:gpu_cache_usage_perc", "KV cache usage (1 = the whole KV budget; older name)", usage))
        for metric, doc, value in gauges:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        for metric, key, doc in (("vllm:prefix_cache_queries", "apc_query_tokens", "Prompt tokens looked up in the "
                                  "prefix cache"),
                                 ("vllm:prefix_cache_hits", "apc_hit_tokens", "Prompt tokens served from the "
                                  "prefix cache")):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], stats.get(key, 0))
            yield family


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, int]],
                 model_name: Callable[[], str | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvarn_requests", "Finished requests by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvarn_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter("kvarn_prompt_cached_tokens", "Prompt tokens of requests served from "
                                            "the prefix cache (their usage's cached_tokens)", registry=r)
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
                               ("kvarn_kv_budget_bytes", "budget_bytes", "The KV budget admission works within"),
                               ("kvarn_kv_allocated_bytes", "kv_allocated_bytes",
                                "Bytes of KV storage allocated: the block pool's arrays or the slot buffers, free "
                                "room included (they grow with the rows; the pool shrinks when the engine is idle)"),
                               ("kvarn_mlx_active_memory_bytes", "mlx_active_bytes", "MLX arrays alive (bytes)"),
                               ("kvarn_mlx_cache_memory_bytes", "mlx_cache_bytes",
                                "Freed buffers MLX keeps for reuse (bytes; emptied when the engine is idle)"),
                               ("kvarn_mlx_peak_memory_bytes", "mlx_peak_bytes",
                                "The most MLX memory active at once since the server started (bytes)")):
            Gauge(name, doc, registry=r).set_function(lambda key=key: stats().get(key, 0))
        r.register(StatsCollector(stats))
        r.register(VllmCollector(stats, model_name))
