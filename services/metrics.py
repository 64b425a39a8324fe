"""Prometheus metrics of one gateway (own registry per app, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sisrl.common.http import RequestMetrics
from sisrl.services.timing import BusyClock

if TYPE_CHECKING:
    from sisrl.services.engines.pool import EnginePool


class GatewayMetrics:
    """Metric names are prefixed `sisrl_gateway_`; docs/gateway.md lists each with its unit."""

    def __init__(self, clock: BusyClock) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http = RequestMetrics(r, requests="sisrl_gateway_http_requests", latency="sisrl_gateway_http_request_seconds")
        self.trajectories = Counter("sisrl_gateway_trajectories", "finished trajectories",
                                    ["data_source", "finish_reason"], registry=r)
        self.trajectory_seconds = Histogram(
            "sisrl_gateway_trajectory_seconds", "wall time of one trajectory (s)",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.reward = Histogram("sisrl_gateway_reward", "trajectory reward",
                                buckets=(0.0, 0.25, 0.5, 0.75, 1.0), registry=r)
        self.pending = Gauge("sisrl_gateway_pending_trajectories", "queued + running trajectories", registry=r)
        self.rejected = Counter("sisrl_gateway_rejected_batches", "batches refused with 429", registry=r)
        self.retriever_requests = Counter("sisrl_gateway_retriever_requests", "retriever HTTP attempts",
                                          ["outcome"], registry=r)
        self.retriever_queries = Counter("sisrl_gateway_retriever_queries", "queries sent to the retriever",
                                         registry=r)
        self.policy_version = Gauge("sisrl_gateway_policy_version", "policy version loaded in the engine",
                                    registry=r)
        busy = Gauge("sisrl_gateway_busy_seconds", "wall time with a call in flight (s)", ["component"],
                     registry=r)
        for component in ("engine", "retriever", "any"):
            busy.labels(component).set_function(_busy_reader(clock, component))

    def watch_engines(self, engine: Any) -> None:
        """Per-server metrics when the engine is a pool of servers (or a scripted engine over one)."""
        from sisrl.services.engines.local import LocalEngine
        from sisrl.services.engines.pool import EnginePool

        pool = engine if isinstance(engine, EnginePool) else getattr(engine, "base", None)
        if isinstance(pool, EnginePool):
            self.registry.register(_PoolCollector(pool))
        local = engine if isinstance(engine, LocalEngine) else getattr(engine, "base", None)
        if isinstance(local, LocalEngine):
            self.registry.register(_LocalCollector(local))

    def record_retriever(self, outcome: str, queries: float) -> None:
        self.retriever_requests.labels(outcome).inc()
        if outcome == "ok":
            self.retriever_queries.inc(queries)


def _busy_reader(clock: BusyClock, component: str) -> Callable[[], float]:
    return lambda: clock.busy_s.get(component, 0.0)


class _LocalCollector(Collector):
    """`sisrl_gateway_local_*_total`: the in-process engine's counters (`EngineStats`), read at scrape time. The
    share of prompt tokens not prefilled again is (prefix_reused + shared_prefix) / prompt tokens."""

    COUNTERS = {
        "requests": "generation requests",
        "generated_tokens": "tokens sampled",
        "prompt_tokens": "prompt tokens asked for (prefilled, reused or shared)",
        "prefix_reused_tokens": "prompt tokens taken from the cache of finished generations (next agent turns)",
        "shared_prefix_tokens": "prompt tokens not prefilled because rows admitted together share them",
        "prefix_hits": "requests that continued a cached generation",
        "forward_passes": "model calls (prefill + decode)",
        "prefill_passes": "prefill calls",
    }

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.engine.stats
        for name, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"sisrl_gateway_local_{name}", doc, value=float(getattr(stats, name)))


class _PoolCollector(Collector):
    """`sisrl_gateway_engine_*{server}`: one series per engine server of a pool, read at scrape time."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        servers = self.pool.servers
        gauges = {
            "in_flight": ("generation requests in flight", lambda s: s.in_flight),
            "up": ("1 while the server takes turns (up, current weights, not loading)",
                   lambda s: float(self.pool._usable(s))),
            "policy_version": ("policy version the server holds", lambda s: s.policy_version),
            "tokens_per_second": ("generated tokens per second of wall time with a request in flight",
                                  lambda s: s.tokens_per_s),
        }
        for name, (doc, read) in gauges.items():
            gauge = GaugeMetricFamily(f"sisrl_gateway_engine_{name}", doc, labels=["server"])
            for server in servers:
                gauge.add_metric([server.url], float(read(server)))
            yield gauge
        counters = {
            "requests": ("generation requests sent", lambda s: s.requests),
            "errors": ("generation requests that failed (the turn went to another server)", lambda s: s.errors),
            "generated_tokens": ("tokens generated", lambda s: s.tokens),
            "trajectories": ("trajectories routed to the server", lambda s: s.trajectories),
        }
        for name, (doc, read) in counters.items():
            counter = CounterMetricFamily(f"sisrl_gateway_engine_{name}", doc, labels=["server"])
            for server in servers:
                counter.add_metric([server.url], float(read(server)))
            yield counter
