"""Prometheus metrics of one server instance (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sisrl.common.http import RequestMetrics

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class Metrics:
    """`sisrl_retriever_*`: HTTP requests and latency, queries per request and per encoder batch, cache use."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = RequestMetrics(self.registry, requests="sisrl_retriever_requests",
                                   latency="sisrl_retriever_request_latency_seconds")
        self.request_queries = Histogram("sisrl_retriever_request_queries", "queries per /retrieve request",
                                         registry=self.registry, buckets=_BATCH_BUCKETS)
        self.encoder_batch = Histogram("sisrl_retriever_encoder_batch_queries",
                                       "queries per encoder call, after dedupe, cache and coalescing",
                                       registry=self.registry, buckets=_BATCH_BUCKETS)
        self.coalesced_requests = Histogram("sisrl_retriever_coalesced_requests",
                                            "requests merged into one encoder call", registry=self.registry,
                                            buckets=_BATCH_BUCKETS)
        self.cache_hits = Counter("sisrl_retriever_cache_hits", "queries answered from the LRU cache",
                                  registry=self.registry)
        self.cache_misses = Counter("sisrl_retriever_cache_misses", "queries not in the LRU cache",
                                    registry=self.registry)
        self.cache_hit_rate = Gauge("sisrl_retriever_cache_hit_rate", "cache hits / (hits + misses) since start",
                                    registry=self.registry)
        self._hits = 0
        self._misses = 0
        self.duplicates = Counter("sisrl_retriever_duplicate_queries", "queries answered by deduplication",
                                  registry=self.registry)

    def record_cache(self, hits: int, misses: int) -> None:
        self.cache_hits.inc(hits)
        self.cache_misses.inc(misses)
        self._hits += hits
        self._misses += misses
        if self._hits + self._misses:
            self.cache_hit_rate.set(self._hits / (self._hits + self._misses))
