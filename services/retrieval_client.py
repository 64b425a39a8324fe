"""Client of a Search-R1 compatible retriever (`POST /retrieve`), with retries and query coalescing.

Concurrent trajectories call `search(query)`; queries that arrive within `window_s` of each other are sent as
one request of up to `batch_size` queries (the retriever encodes and searches them as one batch). Transport
errors, timeouts, 429 and 5xx are retried with exponential backoff and jitter; when the retriever stays down
the caller gets a `RetrievalError` whose message records the last reason.
Wire format: DESIGN.md "Wire contracts" (Search-R1 `retrieval_server.py` request/response shapes).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)


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


class RetrievalClient:
    """Async retriever client; one instance per gateway, shared by every trajectory."""

    def __init__(
        self,
        url: str,
        *,
        topk: int = 3,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        batch_size: int = 64,
        window_s: float = 0.002,
        on_request: Callable[[str, float], None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.topk = topk
        self.retry = retry or RetryPolicy()
        self.batch_size = batch_size
        self.window_s = window_s
        self._on_request = on_request
        self._client = httpx.AsyncClient(timeout=timeout_s)
        self._pending: list[tuple[str, asyncio.Future[list[Passage]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        for task in list(self._sends):
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

    async def search_many(self, queries: list[str]) -> list[list[Passage]]:
        """One request for all `queries` (retried); one passage list per query, in order."""
        body = {"queries": queries, "topk": self.topk, "return_scores": True}
        reason = "no attempt made"
        for attempt in range(self.retry.retries + 1):
            if attempt:
                await asyncio.sleep(self.retry.delay(attempt - 1))
            outcome = "error"
            try:
                resp = await self._client.post(f"{self.url}/retrieve", json=body)
            except httpx.TimeoutException as exc:
                reason = f"timeout ({type(exc).__name__})"
            except httpx.TransportError as exc:
                reason = f"transport error ({type(exc).__name__}: {exc})"
            else:
                if resp.status_code == 200:
                    outcome = "ok"
                    self._record(outcome, len(queries))
                    return self._parse(resp.json(), len(queries))
                reason = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code < 500 and resp.status_code != 429:
                    self._record("rejected", len(queries))
                    raise RetrievalError(f"retriever {self.url} rejected the request: {reason}")
            self._record(outcome, len(queries))
            log.warning("retriever attempt %d/%d failed: %s", attempt + 1, self.retry.retries + 1, reason)
        raise RetrievalError(f"retriever {self.url} unavailable after {self.retry.retries + 1} attempts: {reason}")

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
        try:
            resp = await self._client.get(f"{self.url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200
