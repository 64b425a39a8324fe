"""Client of a Search-R1 compatible retriever (`POST /retrieve`), with retries and query coalescing.

Concurrent trajectories call `search(query)`; queries that arrive within `window_s` of each other are sent as
one request of up to `batch_size` queries (the retriever encodes and searches them as one batch). Transport
errors, timeouts, 429 and 5xx are retried with exponential backoff and jitter; when the retriever stays down
the caller gets a `RetrievalError` whose message records the last reason.

Several retrievers (the same index behind each): every request goes to the healthy one with the fewest requests
in flight. One that fails (transport error, timeout, 429, 5xx) is marked down for `down_s` and the request is
retried at once on another; a down one is probed back (`GET /health`) once its time is up, before it gets
queries again. Only when every retriever is down does a retry wait out the backoff; a request that fails on
all of them for `retry.retries + 1` attempts raises `RetrievalError` naming each one's last reason.

A retriever that requires a bearer token (its `SISRL_RETRIEVER_API_TOKEN`) gets `token` on every request, the
start-up check included; its 401 is a refusal, not an outage: the error says which setting gives the token.

A retriever URL is its base URL or its `/retrieve` endpoint (Search-R1's `retriever.url` is the endpoint): both
name the same server (`retriever_urls`), and every error and warning names the endpoint that was posted to.
Wire format: docs/design.md, "Retrieval" (Search-R1 `retrieval_server.py` request/response shapes).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from sisrl.services.outage import mark_down

log = logging.getLogger(__name__)


ROUTE = "/retrieve"  # Search-R1's retrieval route, relative to a retriever's base URL


class RetrievalError(RuntimeError):
    """The retriever failed for good (after retries) or answered with something unusable."""


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str
    score: float


def parse_document(entry: dict[str, Any]) -> Passage:
    """One result entry `{"document": {"id", "contents"}, "score"}`; contents = title line + text."""
    doc = entry.get("document", entry)
    contents = str(doc["contents"])
    title, _, text = contents.partition("\n")
    return Passage(id=str(doc["id"]), title=title, text=text, score=float(entry.get("score", 0.0)))


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 4
    backoff_s: float = 0.5

    def delay(self, attempt: int) -> float:
        """Backoff before retry `attempt` (0-based): backoff * 2^attempt, scaled by a jitter in [0.5, 1.5)."""
        return self.backoff_s * (2**attempt) * (0.5 + random.random())


@dataclass
class Endpoint:
    """One retriever: its base URL, requests in flight, and until when it is out (`time.monotonic()` seconds)."""

    url: str
    in_flight: int = 0
    down_until: float = 0.0
    failures: int = 0
    last_error: str = field(default="")

    @property
    def down(self) -> bool:
        return self.failures > 0

    @property
    def endpoint(self) -> str:
        return self.url + ROUTE


def split_urls(urls: str | Sequence[str], what: str = "retriever", *, route: str | None = None) -> list[str]:
    """`"http://a:1, http://b:2"` or a list -> distinct base URLs without a trailing slash; none is an error.
    `what` names the servers in the error ("retriever", "engine"); `route`, when given, is cut from a URL that
    ends with it (`http://a:1/retrieve/` -> `http://a:1`), before URLs are compared."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip().rstrip("/") for u in items if u.strip()]
    if route is not None:
        out = [u.removesuffix(route).rstrip("/") for u in out]
    if not out:
        raise ValueError(f"expected at least one {what} URL, got {urls!r}")
    for url in out:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{what} URL {url!r} must start with http:// or https://")
    if len(set(out)) != len(out):
        raise ValueError(f"{what} URLs must be distinct, got {out}")
    return out


def retriever_urls(urls: str | Sequence[str]) -> list[str]:
    """Retriever base URLs from the base or the `/retrieve` endpoint of each (comma-separated, or a list)."""
    return split_urls(urls, route=ROUTE)


TOKEN_SETTING = "SISRL_GATEWAY_RETRIEVER_TOKEN"  # where a gateway gets the token it sends (services/settings.py)


def _hint(status: int) -> str:
    """What a refusal most likely means, for the error text."""
    if status == 401:
        return (f" (the retriever requires a bearer token: set {TOKEN_SETTING} to its SISRL_RETRIEVER_API_TOKEN; "
                "a token is sent only when that is set)")
    if status in (404, 405):
        return " (no Search-R1 /retrieve route there: give the retriever's base URL or its /retrieve endpoint)"
    return ""


def _report(ep: Endpoint, problem: str) -> None:
    """The start-up check's one line per retriever (`RetrievalClient.check`)."""
    if problem:
        log.warning("retriever %s does not answer at start-up: %s; every search fails until it does",
                    ep.endpoint, problem)
    else:
        log.info("retriever %s answers", ep.endpoint)


class RetrievalClient:
    """Async client of one or more retrievers; one instance per gateway, shared by every trajectory."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        topk: int = 3,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        batch_size: int = 64,
        window_s: float = 0.002,
        down_s: float = 5.0,
        on_request: Callable[[str, float], None] | None = None,
        token: str | None = None,
    ) -> None:
        """`token`: sent as `Authorization: Bearer <token>` on every request (None: no header)."""
        self.endpoints = [Endpoint(u) for u in retriever_urls(url)]
        self.url = self.endpoints[0].url  # the first one (kept for callers that know a single retriever)
        self.topk = topk
        self.retry = retry or RetryPolicy()
        self.batch_size = batch_size
        self.window_s = window_s
        self.down_s = down_s
        self._on_request = on_request
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self._pending: list[tuple[str, asyncio.Future[list[Passage]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()
        self._check: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        for task in [*self._sends, *([self._check] if self._check else [])]:
            task.cancel()
        await self._client.aclose()

    async def search(self, query: str) -> list[Passage]:
        """Top-k passages of one query; coalesced with concurrent callers' queries."""
        future: asyncio.Future[list[Passage]] = asyncio.get_running_loop().create_future()
        self._pending.append((query, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            await asyncio.sleep(self.window_s)
            chunk, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size :]
            task = asyncio.create_task(self._send(chunk))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _send(self, chunk: list[tuple[str, asyncio.Future[list[Passage]]]]) -> None:
        try:
            results = await self.search_many([query for query, _ in chunk])
        except Exception as exc:  # every waiter gets the failure, none hangs
            for _, future in chunk:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), passages in zip(chunk, results, strict=True):
            if not future.done():
                future.set_result(passages)

    async def _pick(self, tried: set[str]) -> Endpoint | None:
        """The up endpoint with the fewest requests in flight that this attempt round has not tried; a down one
        whose time is up is probed first and rejoins when its /health answers. None: nothing left to try now."""
        now = time.monotonic()
        for ep in self.endpoints:
            if ep.down and ep.down_until <= now and ep.url not in tried:
                if await self._probe(ep):
                    log.warning("retriever %s is back (its /health answered)", ep.url)
                    ep.failures, ep.last_error = 0, ""
                else:
                    self._mark_down(ep, ep.last_error or "/health did not answer")
        up = [ep for ep in self.endpoints if not ep.down and ep.url not in tried]
        return min(up, key=lambda ep: ep.in_flight) if up else None

    def _mark_down(self, ep: Endpoint, reason: str) -> None:
        mark_down(ep, reason, self.down_s)  # services/outage.py

    async def _probe(self, ep: Endpoint) -> bool:
        try:
            resp = await self._client.get(f"{ep.url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def search_many(self, queries: list[str]) -> list[list[Passage]]:
        """One request for all `queries` (retried, on another retriever first); one passage list per query."""
        body = {"queries": queries, "topk": self.topk, "return_scores": True}
        reasons: dict[str, str] = {}
        tried: set[str] = set()
        for attempt in range(self.retry.retries + 1):
            ep = await self._pick(tried)
            if ep is None:  # every retriever tried (or down): wait, then start a new round over all of them
                if attempt:
                    await asyncio.sleep(self.retry.delay(attempt - 1))
                tried.clear()
                ep = await self._pick(tried)
                if ep is None:  # still all down: try the one that comes back first anyway
                    ep = min(self.endpoints, key=lambda e: e.down_until)
            tried.add(ep.url)
            reason = await self._attempt(ep, body, len(queries))
            if isinstance(reason, list):
                return reason
            reasons[ep.url] = reason
            self._mark_down(ep, reason)
            log.warning("retriever %s attempt %d/%d failed: %s", ep.endpoint, attempt + 1, self.retry.retries + 1, reason)
        where = "; ".join(f"{url}{ROUTE}: {why}" for url, why in reasons.items())
        if len(self.endpoints) == 1:
            raise RetrievalError(f"retriever {self.url}{ROUTE} unavailable after {self.retry.retries + 1} "
                                 f"attempts: {reasons[self.url]}")
        raise RetrievalError(f"all {len(self.endpoints)} retrievers unavailable after {self.retry.retries + 1} "
                             f"attempts: {where}")

    async def _attempt(self, ep: Endpoint, body: dict[str, Any], n: int) -> list[list[Passage]] | str:
        """The passages, or why this endpoint failed (retryable); a request the retriever rejects (4xx but 429)
        raises at once, since every retriever would reject it alike."""
        ep.in_flight += 1
        try:
            resp = await self._client.post(ep.endpoint, json=body)
        except httpx.TimeoutException as exc:
            reason = f"timeout ({type(exc).__name__})"
        except httpx.TransportError as exc:
            reason = f"transport error ({type(exc).__name__}: {exc})"
        else:
            if resp.status_code == 200:
                self._record("ok", n)
                return self._parse(resp.json(), n)
            reason = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if resp.status_code < 500 and resp.status_code != 429:
                self._record("rejected", n)
                raise RetrievalError(f"retriever {ep.endpoint} rejected the request: {reason}"
                                     f"{_hint(resp.status_code)}")
        finally:
            ep.in_flight -= 1
        self._record("error", n)
        return reason

    def _record(self, outcome: str, n: int) -> None:
        if self._on_request is not None:
            self._on_request(outcome, float(n))

    @staticmethod
    def _parse(payload: Any, n: int) -> list[list[Passage]]:
        result = payload.get("result") if isinstance(payload, dict) else None
        if not isinstance(result, list) or len(result) != n:
            raise RetrievalError(f"retriever answer has no 'result' list of {n} entries: {str(payload)[:200]}")
        try:
            return [[parse_document(entry) for entry in hits] for hits in result]
        except (KeyError, TypeError, ValueError) as exc:
            raise RetrievalError(f"retriever answer has a malformed document: {exc!r}") from exc

    async def healthy(self) -> bool:
        """True when at least one retriever answers /health."""
        for ep in self.endpoints:
            if await self._probe(ep):
                return True
        return False

    async def check(self, *, patience_s: float = 30.0, every_s: float = 1.0) -> None:
        """Send each retriever one single-query `POST /retrieve` now and log the outcome before the caller goes on:
        info when it answers, a warning naming the endpoint and the reason when it refuses (a 4xx: the wrong
        URL). One that does not answer (down, or still loading its index) is asked again every `every_s` by a
        background task (cancelled by `aclose`), and named in a warning when `patience_s` pass without an answer.
        Searches never wait for this, and it counts in no metric."""
        tries = await asyncio.gather(*(self._try_retrieve(ep, timeout_s=5.0) for ep in self.endpoints))
        later: list[Endpoint] = []
        for ep, (problem, refused) in zip(self.endpoints, tries, strict=True):
            if problem and not refused:
                later.append(ep)
            else:
                _report(ep, problem)
        if later:
            self._check = asyncio.create_task(self._keep_asking(later, patience_s, every_s))

    async def _keep_asking(self, endpoints: list[Endpoint], patience_s: float, every_s: float) -> None:
        async def one(ep: Endpoint) -> None:
            deadline = time.monotonic() + patience_s
            problem, refused = "no answer", False
            while time.monotonic() + every_s <= deadline:
                await asyncio.sleep(every_s)
                problem, refused = await self._try_retrieve(ep, timeout_s=5.0)
                if not problem or refused:
                    break
            _report(ep, problem if not problem or refused else f"{problem}; asked for {patience_s:g} s")

        await asyncio.gather(*(one(ep) for ep in endpoints))

    async def _try_retrieve(self, ep: Endpoint, *, timeout_s: float) -> tuple[str, bool]:
        """(problem, refused) of one single-query `POST /retrieve`: problem "" when it answered; refused when the
        answer was a 4xx other than 429 (or unusable), which asking again does not change."""
        body = {"queries": ["start-up check"], "topk": 1, "return_scores": True}
        try:
            resp = await self._client.post(ep.endpoint, json=body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            return f"no answer ({type(exc).__name__}: {exc})", False
        if resp.status_code != 200:
            refused = resp.status_code < 500 and resp.status_code != 429
            return f"HTTP {resp.status_code}: {resp.text[:200]}{_hint(resp.status_code)}", refused
        try:
            self._parse(resp.json(), 1)
        except (RetrievalError, ValueError) as exc:
            return str(exc), True
        return "", True
