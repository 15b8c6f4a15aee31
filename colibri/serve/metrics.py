"""GET /metrics: Prometheus figures of the server and its engine (prometheus-client).

Counters and histograms are updated as requests run; the engine's figures (expert cache hits,
misses, bytes read, occupancy, queue depth, running sequences) are read from
EngineStatistics at scrape time by a collector, so they are never stale or double counted.
Each app has its own registry (several servers can live in one process, as in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    def __init__(self, read: Callable[[], Any]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        s = self._read()  # EngineStatistics

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(f"colibri_{name}", doc)
            m.add_metric([], value)
            return m

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(f"colibri_{name}", doc)
            m.add_metric([], value)
            return m

        yield counter("expert_hits", "expert cache gets served from RAM", s.expert_hits)
        yield counter("expert_misses", "expert cache gets that needed a read", s.expert_misses)
        yield counter("expert_bytes_read", "bytes of expert records read", s.bytes_read)
        yield gauge("expert_hit_rate", "expert cache hit rate since start", s.hit_rate)
        yield gauge("cache_used_bytes", "expert cache bytes holding records", s.cache_used_nbytes)
        yield gauge("cache_budget_bytes", "expert cache budget in bytes", s.cache_budget_nbytes)
        yield gauge("cache_leased", "expert cache entries held by a computation", s.leased)
        yield gauge("reads_in_flight", "expert reads in flight", s.reads_in_flight)
        yield gauge("running_sequences", "sequences being decoded", s.running)
        yield gauge("queue_depth", "requests waiting for a sequence slot", s.waiting)
        yield gauge("prefix_cache_bytes", "bytes of KV held by the prefix cache", s.prefix_nbytes)
        yield counter(
            "prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", s.prefix_hits
        )
        if getattr(s, "cluster", None) is not None:  # --cluster: one series per expert owner
            c = s.cluster
            per = [
                ("cluster_owner_latency_ms", "mean ffn call round trip per owner, ms", "mean_ms",
                 GaugeMetricFamily),
                ("cluster_owner_calls", "ffn calls answered per owner", "calls",
                 CounterMetricFamily),
                ("cluster_owner_errors", "ffn calls failed per owner", "errors",
                 CounterMetricFamily),
                ("cluster_owner_restarts", "times an owner came back after failing", "restarts",
                 CounterMetricFamily),
            ]  # fmt: skip
            for name, doc, field, kind in per:
                m = kind(f"colibri_{name}", doc, labels=["owner", "node"])
                for o in c.owners:
                    m.add_metric([str(o.index), o.node], getattr(o, field))
                yield m
            yield gauge(
                "cluster_layer_round_trip_ms", "mean per-layer round trip, ms", c.round_trip_ms
            )
            yield counter(
                "cluster_wire_bytes", "array bytes to and from the owners",
                c.bytes_sent + c.bytes_received,
            )  # fmt: skip


class Metrics:
    """The server's Prometheus metrics; `engine_statistics` returns an EngineStatistics."""

    def __init__(self, engine_statistics: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "colibri_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("colibri_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "colibri_generation_tokens", "generated tokens", registry=r
        )
        self.ttft = Histogram(
            "colibri_time_to_first_token_seconds", "time to first token",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token = Histogram(
            "colibri_inter_token_latency_seconds", "time between two generated tokens",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_EngineCollector(engine_statistics))

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
