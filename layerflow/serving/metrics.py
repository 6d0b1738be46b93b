"""The serving layer's Prometheus metrics, in a registry of their own (one per server, never the global one).

The scheduler reports what happened (`request_done`, `request_failed`, `batch_prepared`, ...); `/metrics` renders
`text()`. Pool occupancy is sampled by the scheduler thread (the only thread that touches the engine), so a scrape
never reads the KV manager while a batch changes it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from layerflow.serving.errors import ERROR_KINDS
from layerflow.tier.base import Tier

LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class ServingMetrics:
    """Counters, gauges and histograms of one server; every name starts with `layerflow_`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.latency = Histogram("layerflow_request_latency_seconds", "Arrival to answer of a served request, by the "
                                 "tier its KV came from", ["tier"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.errors = Counter("layerflow_request_errors", "Requests answered with an error, by kind", ["kind"],
                              registry=r)
        self.queue_depth = Gauge("layerflow_queue_depth", "Requests waiting to be batched", registry=r)
        self.batch_size = Histogram("layerflow_batch_size", "Requests per launched batch", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.prefetched = Counter("layerflow_prefetched_batches", "Batches prepared while another was in flight",
                                  registry=r)
        self.prefetch_deferred = Counter("layerflow_prefetch_deferred", "Prefetches put off because the GPU pool "
                                         "could not hold the next batch beside the one in flight", registry=r)
        self.failed_batches = Counter("layerflow_failed_batches", "Batches that failed and had their requests "
                                      "retried alone", registry=r)
        self.onboard_bytes = Counter("layerflow_onboard_bytes", "KV bytes onboarded from host or SSD", registry=r)
        self.onboard_rate = Gauge("layerflow_onboard_rate_bytes_per_second", "The last onboarded batch's bytes over "
                                  "its prepare-to-collect time (a lower bound of the copy rate)", registry=r)
        self.gpu_evictions = Counter("layerflow_gpu_evictions", "Users whose GPU pages were evicted for a batch",
                                     registry=r)
        self.gpu_pages = Gauge("layerflow_gpu_pool_pages", "GPU KV pool pages", ["state"], registry=r)
        self.host_blocks = Gauge("layerflow_host_pool_blocks", "Host KV pool blocks", ["state"], registry=r)
        self.pool_users = Gauge("layerflow_pool_users", "Users resident in a pool", ["pool"], registry=r)
        # each label's child looked up once: `labels()` takes a lock and builds a key on every call
        self._latency_by_tier = {tier: self.latency.labels(tier.value) for tier in Tier}
        self._errors_by_kind = {kind: self.errors.labels(kind) for kind in ERROR_KINDS}

    def request_done(self, tier: Tier, latency_s: float) -> None:
        self._latency_by_tier[tier].observe(latency_s)

    def request_failed(self, kind: str) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {ERROR_KINDS}")
        self._errors_by_kind[kind].inc()

    def batch_prepared(self, prefetched: bool, onboard_bytes: int, evictions: int) -> None:
        if prefetched:
            self.prefetched.inc()
        self.onboard_bytes.inc(onboard_bytes)
        self.gpu_evictions.inc(evictions)

    def batch_collected(self, size: int, onboard_bytes: int, seconds: float) -> None:
        self.batch_size.observe(size)
        if onboard_bytes and seconds > 0:
            self.onboard_rate.set(onboard_bytes / seconds)

    def pools(self, gpu_used: int, gpu_total: int, gpu_users: int, host_used: int, host_total: int,
              host_users: int) -> None:
        self.gpu_pages.labels("used").set(gpu_used)
        self.gpu_pages.labels("total").set(gpu_total)
        self.host_blocks.labels("used").set(host_used)
        self.host_blocks.labels("total").set(host_total)
        self.pool_users.labels("gpu").set(gpu_users)
        self.pool_users.labels("host").set(host_users)

    def text(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
