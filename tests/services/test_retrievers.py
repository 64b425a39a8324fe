"""Several retrievers behind one client: queries spread over the healthy ones, a failing one is skipped and
probed back, and a search that fails everywhere names every retriever's reason.

The retrievers here are stub servers (real uvicorn on 127.0.0.1, spoken to over HTTP) because the test is about
failure handling: each one can be told to answer, to fail with a status, or to stop.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from sisrl.common.procs import free_port
from sisrl.services.retrieval_client import RetrievalClient, RetrievalError, RetryPolicy, split_urls
from sisrl.services.settings import GatewaySettings


class StubRetriever:
    """`POST /retrieve` answers with this server's name as the passage id, or with `status` when set."""

    def __init__(self, name: str) -> None:
        self.name, self.status, self.retrieves, self.health_checks = name, 200, 0, 0
        app = FastAPI()

        @app.post("/retrieve")
        async def retrieve(request: Request) -> Response:
            body = await request.json()
            self.retrieves += 1
            await asyncio.sleep(0.02)  # long enough for concurrent requests to overlap
            if self.status != 200:
                return Response("failing on purpose", status_code=self.status)
            hits = [[{"document": {"id": self.name, "contents": f"{self.name}\n{q}"}, "score": 1.0}]
                    for q in body["queries"]]
            return Response(json.dumps({"result": hits}), media_type="application/json")

        @app.get("/health")
        async def health() -> Response:
            self.health_checks += 1
            return Response("{}", status_code=200 if self.status == 200 else 503)

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, f"stub retriever {name} did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def stubs() -> Iterator[tuple[StubRetriever, StubRetriever]]:
    a, b = StubRetriever("a"), StubRetriever("b")
    yield a, b
    for stub in (a, b):
        stub.stop()


def _client(*stubs: StubRetriever, retries: int = 3) -> RetrievalClient:
    return RetrievalClient([s.url for s in stubs], topk=1, window_s=0.0, down_s=0.3,
                           retry=RetryPolicy(retries=retries, backoff_s=0.01))


async def _answered_by(client: RetrievalClient, n: int) -> list[str]:
    results = await asyncio.gather(*(client.search_many([f"query {i}"]) for i in range(n)))
    return [hits[0].id for (hits,) in results]


def test_queries_spread_over_healthy_retrievers(stubs: tuple[StubRetriever, StubRetriever]) -> None:
    a, b = stubs

    async def run() -> list[str]:
        client = _client(a, b)
        try:
            return await _answered_by(client, 8)
        finally:
            await client.aclose()

    answered = asyncio.run(run())
    assert len(answered) == 8 and {"a", "b"} == set(answered), answered  # least in flight: both get work
    assert a.retrieves + b.retrieves == 8  # nothing sent twice


def test_a_failing_retriever_is_skipped_then_probed_back(stubs: tuple[StubRetriever, StubRetriever]) -> None:
    a, b = stubs
    a.status = 503

    async def run() -> tuple[list[str], list[str], int]:
        client = _client(a, b)
        try:
            first = await _answered_by(client, 6)
            failed_calls = a.retrieves
            a.status = 200  # recovered; its down time (0.3 s) has to pass and /health answer first
            await asyncio.sleep(0.4)
            later = await _answered_by(client, 6)
            return first, later, failed_calls
        finally:
            await client.aclose()

    first, later, failed_calls = asyncio.run(run())
    assert first == ["b"] * 6  # every query answered although a fails
    assert 1 <= failed_calls <= 6  # a is tried, then skipped while down
    assert a.health_checks >= 1 and "a" in later  # probed back, and then it gets queries again


def test_a_search_that_fails_everywhere_names_each_retriever(stubs: tuple[StubRetriever, StubRetriever]) -> None:
    a, b = stubs
    a.status = 503
    b.stop()  # connection refused

    async def run() -> None:
        client = _client(a, b, retries=3)
        try:
            await client.search_many(["anything"])
        finally:
            await client.aclose()

    with pytest.raises(RetrievalError) as info:
        asyncio.run(run())
    message = str(info.value)
    assert "all 2 retrievers unavailable after 4 attempts" in message
    assert f"{a.url}/retrieve: HTTP 503" in message and f"{b.url}/retrieve: transport error" in message


def test_a_rejected_request_is_not_retried_elsewhere(stubs: tuple[StubRetriever, StubRetriever]) -> None:
    a, b = stubs
    a.status = b.status = 422  # the request's fault: every retriever would refuse it alike

    async def run() -> None:
        client = _client(a, b)
        try:
            await client.search_many(["anything"])
        finally:
            await client.aclose()

    with pytest.raises(RetrievalError, match="rejected the request: HTTP 422"):
        asyncio.run(run())
    assert a.retrieves + b.retrieves == 1


def test_the_setting_takes_a_comma_separated_list() -> None:
    settings = GatewaySettings(retriever_url="http://127.0.0.1:8000, http://127.0.0.1:8001/")
    assert split_urls(settings.retriever_url) == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    with pytest.raises(ValueError, match="retriever_url: retriever URL 'localhost:8000' must start with http"):
        GatewaySettings(retriever_url="http://127.0.0.1:8000,localhost:8000")


def test_a_retriever_url_may_be_its_retrieve_endpoint() -> None:
    """Search-R1's `retriever.url` is the full endpoint: `/retrieve` (and a trailing slash) name the same server,
    so two spellings of one server are one URL, and engine URLs keep their path."""
    settings = GatewaySettings(retriever_url="http://127.0.0.1:8000/retrieve, http://10.0.0.6:8000/retrieve/, "
                                             "http://10.0.0.7:8000/api/")
    assert settings.retriever_urls == ["http://127.0.0.1:8000", "http://10.0.0.6:8000", "http://10.0.0.7:8000/api"]
    client = RetrievalClient("http://127.0.0.1:8000/retrieve/")
    assert client.url == "http://127.0.0.1:8000" and client.endpoints[0].endpoint == "http://127.0.0.1:8000/retrieve"
    with pytest.raises(ValueError, match="retriever URLs must be distinct"):
        GatewaySettings(retriever_url="http://127.0.0.1:8000,http://127.0.0.1:8000/retrieve")
    assert split_urls("http://127.0.0.1:8001/retrieve", what="engine") == ["http://127.0.0.1:8001/retrieve"]
