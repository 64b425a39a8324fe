"""The admission gate (sisrl.common.admission) on a real uvicorn server on loopback: a route whose work waits on an
event the test controls, so every state (running, queued, refused, cancelled) is reached without timing races."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, generate_latest
from sisrl.common.admission import AdmissionGate
from sisrl.common.procs import free_port


@dataclass
class Work:
    """What the route's work saw: started and finished calls, the ones cancelled; `release` lets them finish."""

    started: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    cancel_s: float = 0.0  # how long stopping takes once cancelled (an engine finishing its step)

    async def __call__(self, n: int) -> int:
        self.started.append(n)
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled.append(n)
            await asyncio.sleep(self.cancel_s)
            raise
        self.finished.append(n)
        return n


@dataclass
class Served:
    url: str
    work: Work
    registry: CollectorRegistry

    def metric(self, name: str) -> float:
        for line in generate_latest(self.registry).decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {name}")

    def wait_for(self, name: str, value: float, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.metric(name) != value:
            assert time.monotonic() < deadline, f"{name} = {self.metric(name)}, expected {value}"
            time.sleep(0.01)


@contextlib.contextmanager
def serve(max_in_flight: int, max_queued: int, timeout_s: float) -> Iterator[Served]:
    registry, work = CollectorRegistry(), Work()
    gate = AdmissionGate(max_in_flight=max_in_flight, max_queued=max_queued, timeout_s=timeout_s, registry=registry,
                         prefix="t")
    app = FastAPI()

    @app.post("/work/{n}")
    async def run(n: int, request: Request) -> int:
        return await gate.run(request, work(n))

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield Served(f"http://127.0.0.1:{port}", work, registry)
    work.release.set()
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def one_slot() -> Iterator[Served]:
    """One request in flight, one queued, a 30 s deadline."""
    with serve(1, 1, 30.0) as served:
        yield served


def post_in_background(url: str, results: dict[int, httpx.Response], n: int, timeout_s: float = 30.0) -> threading.Thread:
    def go() -> None:
        try:
            results[n] = httpx.post(f"{url}/work/{n}", timeout=timeout_s)
        except httpx.TimeoutException:
            pass

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def test_past_the_queue_a_request_gets_429_with_retry_after_and_the_queue_runs_in_order(one_slot: Served) -> None:
    results: dict[int, httpx.Response] = {}
    first = post_in_background(one_slot.url, results, 1)
    one_slot.wait_for("t_in_flight", 1)
    second = post_in_background(one_slot.url, results, 2)
    one_slot.wait_for("t_queued", 1)
    refused = httpx.post(f"{one_slot.url}/work/3", timeout=10)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert "settings max_in_flight, max_queued" in refused.json()["detail"]
    assert one_slot.work.started == [1]  # the queued one has not started
    one_slot.work.release.set()
    first.join(10)
    second.join(10)
    assert results[1].json() == 1 and results[2].json() == 2 and one_slot.work.started == [1, 2]
    assert one_slot.metric("t_in_flight") == 0 and one_slot.metric("t_queued") == 0
    assert one_slot.metric('t_rejected_total{reason="full"}') == 1


def test_a_client_that_goes_away_cancels_its_work_and_frees_the_place(one_slot: Served) -> None:
    results: dict[int, httpx.Response] = {}
    gone = post_in_background(one_slot.url, results, 1, timeout_s=0.5)  # the client gives up after 0.5 s
    one_slot.wait_for("t_in_flight", 1)
    gone.join(10)
    one_slot.wait_for("t_in_flight", 0, timeout_s=2.0)
    assert one_slot.work.cancelled == [1] and one_slot.work.finished == []
    assert one_slot.metric('t_cancelled_total{reason="disconnect"}') == 1
    one_slot.work.release.set()
    assert httpx.post(f"{one_slot.url}/work/2", timeout=10).json() == 2  # the place was handed back


def test_the_deadline_cancels_running_work_and_refuses_a_request_still_queued() -> None:
    results: dict[int, httpx.Response] = {}
    with serve(1, 1, 0.5) as served:
        served.work.cancel_s = 0.3  # 1 holds its place until 0.8 s, past the deadline of 2 (0.5 s + a little)
        threads = [post_in_background(served.url, results, 1)]
        served.wait_for("t_in_flight", 1)
        threads.append(post_in_background(served.url, results, 2))
        served.wait_for("t_queued", 1)
        for thread in threads:
            thread.join(10)
        assert served.work.started == [1] and served.work.cancelled == [1] and served.work.finished == []
        assert served.metric("t_in_flight") == 0 and served.metric("t_queued") == 0
        assert served.metric('t_cancelled_total{reason="deadline"}') == 1
        assert served.metric('t_rejected_total{reason="deadline"}') == 1
    assert results[1].status_code == 503, results[1].text
    assert "ran past its deadline of 0.5 s (setting request_timeout_s)" in results[1].json()["detail"]
    assert results[2].status_code == 503 and "0.5 s in the queue" in results[2].json()["detail"]
    assert all(int(r.headers["retry-after"]) >= 1 for r in results.values())


def test_bad_caps_are_refused() -> None:
    with pytest.raises(ValueError, match="max_in_flight >= 1"):
        AdmissionGate(max_in_flight=0, max_queued=0, timeout_s=1, registry=CollectorRegistry(), prefix="t")
