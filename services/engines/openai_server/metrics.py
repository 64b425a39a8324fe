"""Prometheus metrics of one policy server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from sisrl.common.http import RequestMetrics
from sisrl.services.engines.local import LocalEngine


class EngineMetrics:
    """`sisrl_engine_requests_total{method,route,status}`, `sisrl_engine_request_seconds{route}` (docs/engines.md),
    `sisrl_engine_generated_tokens_total` (tokens of answered completions), and, read from the engine at each
    scrape, `sisrl_engine_sequences` (generations in the engine) and `sisrl_engine_sampled_tokens` (every token
    sampled since start, cancelled generations' included). The admission gauges and counters
    (`sisrl_engine_in_flight`, ...: sisrl.common.admission) share the registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = RequestMetrics(self.registry, requests="sisrl_engine_requests", latency="sisrl_engine_request_seconds")
        self.tokens = Counter("sisrl_engine_generated_tokens", "Generated tokens", registry=self.registry)
        self.sequences = Gauge("sisrl_engine_sequences", "generations waiting or decoding in the engine",
                               registry=self.registry)
        self.sampled = Gauge("sisrl_engine_sampled_tokens", "tokens sampled since start, cancelled generations' "
                             "included", registry=self.registry)

    def watch(self, engine: Callable[[], LocalEngine | None]) -> None:
        """Read the engine's counts at each scrape (`engine()` is None before the lifespan loads it)."""
        self.sequences.set_function(lambda: (e := engine()) is not None and e.running or 0)
        self.sampled.set_function(lambda: (e := engine()) is not None and e.stats.generated_tokens or 0)
