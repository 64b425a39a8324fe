"""Bounded work for a service's expensive route (the retriever's /retrieve, the policy server's /v1/completions).

Rules, the same for both (docs/design.md, "Cross-cutting requirements"):
- At most `max_in_flight` requests run at once; up to `max_queued` more wait, first come first served. One more
  is answered at once with 429 and `Retry-After` (seconds): the queue is full, and waiting is the client's.
- Each request has a deadline, `timeout_s` after it arrived, queue wait included. A request still queued at its
  deadline, or still running, is answered 503 with `Retry-After`; a running one is cancelled first.
- A request whose client goes away (the connection closes: a client timeout, a killed process) is cancelled at
  once, so no engine keeps generating for nobody; it is logged with status 499 (nginx's "client closed request").
`Retry-After` is the mean run time of the last requests times the queue ahead over the places in flight,
rounded up, at least 1 and at most MAX_RETRY_AFTER_S. Metrics, in the service's registry and namespace:
`<prefix>_in_flight`, `<prefix>_queued` (gauges), `<prefix>_rejected_total{reason=full|deadline}` and
`<prefix>_cancelled_total{reason=disconnect|deadline}`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from prometheus_client import CollectorRegistry, Counter, Gauge

T = TypeVar("T")
log = logging.getLogger(__name__)
MAX_RETRY_AFTER_S = 60
CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection first


class AdmissionGate:
    """In-flight and queue caps, a deadline and cancellation on disconnect for one route (module docstring).

    `settings` names the three options (in-flight cap, queue cap, deadline) as the errors quote them."""

    def __init__(self, *, max_in_flight: int, max_queued: int, timeout_s: float, registry: CollectorRegistry,
                 prefix: str, settings: tuple[str, str, str] = ("max_in_flight", "max_queued",
                                                                "request_timeout_s")) -> None:
        if max_in_flight < 1 or max_queued < 0 or timeout_s <= 0:
            raise ValueError(f"expected max_in_flight >= 1, max_queued >= 0 and timeout_s > 0, got {max_in_flight}, "
                             f"{max_queued}, {timeout_s}")
        self.max_in_flight, self.max_queued, self.timeout_s = max_in_flight, max_queued, timeout_s
        self.settings = settings
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._mean_s = 0.0  # exponentially weighted mean run time of finished requests
        Gauge(f"{prefix}_in_flight", "requests running now", registry=registry).set_function(lambda: self.in_flight)
        Gauge(f"{prefix}_queued", "requests waiting for a place in flight", registry=registry).set_function(
            lambda: self.queued)
        self.rejected = Counter(f"{prefix}_rejected", "requests answered 429 (queue full) or 503 (deadline in the "
                                "queue) without running", ["reason"], registry=registry)
        self.cancelled = Counter(f"{prefix}_cancelled", "running requests cancelled: client gone or deadline",
                                 ["reason"], registry=registry)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def retry_after(self) -> int:
        """Seconds a refused client should wait (module docstring)."""
        ahead = self.queued + 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self._mean_s * ahead / self.max_in_flight)))

    async def run(self, request: Request, work: Coroutine[Any, Any, T]) -> T:
        """`work`'s result once admitted; 429 / 503 (HTTPException with Retry-After) as the rules say, 499 when the
        client went away. `work` starts only once admitted, and is cancelled wherever it does not finish."""
        deadline = time.monotonic() + self.timeout_s
        try:
            await self._enter(deadline)
        except BaseException:
            work.close()  # never started
            raise
        started = time.monotonic()
        try:
            return await self._watch(request, asyncio.ensure_future(work), deadline)
        finally:
            self._mean_s += 0.2 * ((time.monotonic() - started) - self._mean_s)
            self._leave()

    async def _enter(self, deadline: float) -> None:
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            return
        in_flight, queue, _ = self.settings
        if self.queued >= self.max_queued:
            self.rejected.labels("full").inc()
            raise self._refusal(429, f"busy: {self.in_flight} requests in flight and {self.queued} queued, the "
                                     f"limits (settings {in_flight}, {queue})")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await asyncio.wait({turn}, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:  # this request was cancelled while it waited
            if turn.done():  # handed a place just before: pass it on
                self._leave()
            else:
                turn.cancel()
                self._waiters.remove(turn)
            raise
        if not turn.done():  # the deadline passed in the queue
            turn.cancel()
            self._waiters.remove(turn)
            self.rejected.labels("deadline").inc()
            raise self._refusal(503, f"waited {self.timeout_s:g} s in the queue, the deadline (setting "
                                     f"{self.settings[2]})")

    def _leave(self) -> None:
        """Hand this place to the first live waiter, else free it."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.in_flight -= 1

    async def _watch(self, request: Request, task: asyncio.Future[T], deadline: float) -> T:
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            either: set[asyncio.Future[Any]] = {task, gone}
            await asyncio.wait(either, timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # stopped before its place is handed on
        if not task.cancelled():
            return task.result()
        if gone.done() and not gone.cancelled():
            self.cancelled.labels("disconnect").inc()
            log.info("client went away: %s %s cancelled", request.method, request.url.path)
            raise HTTPException(CLIENT_CLOSED, detail="client closed the connection; the request was cancelled")
        self.cancelled.labels("deadline").inc()
        raise self._refusal(503, f"ran past its deadline of {self.timeout_s:g} s (setting {self.settings[2]}) "
                                 "and was cancelled")

    def _refusal(self, status: int, why: str) -> HTTPException:
        wait = self.retry_after()
        return HTTPException(status, detail=f"{why}; retry after {wait} s", headers={"Retry-After": str(wait)})


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection. The body was read before the handler ran, so the only
    message left to receive is `http.disconnect` (sent by uvicorn when the socket closes, or once the response
    is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
