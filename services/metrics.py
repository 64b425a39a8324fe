"""Prometheus metrics of one gateway (own registry per app, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sisrl.common.http import RequestMetrics
from sisrl.services.timing import BusyClock


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

    def record_retriever(self, outcome: str, queries: float) -> None:
        self.retriever_requests.labels(outcome).inc()
        if outcome == "ok":
            self.retriever_queries.inc(queries)


def _busy_reader(clock: BusyClock, component: str) -> Callable[[], float]:
    return lambda: clock.busy_s.get(component, 0.0)
