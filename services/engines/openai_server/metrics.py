"""Prometheus metrics of one policy server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from sisrl.common.http import RequestMetrics


class EngineMetrics:
    """`sisrl_engine_requests_total{method,route,status}`, `sisrl_engine_request_seconds{route}` (docs/engines.md)
    and `sisrl_engine_generated_tokens_total`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = RequestMetrics(self.registry, requests="sisrl_engine_requests", latency="sisrl_engine_request_seconds")
        self.tokens = Counter("sisrl_engine_generated_tokens", "Generated tokens", registry=self.registry)
