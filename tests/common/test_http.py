"""sisrl.common.http on a two-route app: request ids, the body limit, metrics labels, access log, bearer token."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, SecretStr
from sisrl.common.http import (
    JsonFormatter,
    RequestMetrics,
    ServiceMiddleware,
    bearer_dependency,
    request_id_var,
)

TOKEN = "s3cret-token"


class Echo(BaseModel):
    text: str
    request_id: str


def _app(token: SecretStr | None) -> tuple[FastAPI, CollectorRegistry]:
    registry = CollectorRegistry()
    app = FastAPI()
    app.add_middleware(ServiceMiddleware, metrics=RequestMetrics(registry, requests="t_requests", latency="t_seconds"),
                       max_body=64, limit_setting="max_body", access_log=logging.getLogger("test.access"))
    auth = Depends(bearer_dependency(lambda request: token))

    @app.post("/echo/{name}", response_model=Echo, dependencies=[auth])
    async def echo(name: str, request: Request) -> Echo:
        return Echo(text=name + (await request.body()).decode(), request_id=request_id_var.get())

    return app, registry


@pytest.fixture()
def open_client() -> Iterator[tuple[TestClient, CollectorRegistry]]:
    app, registry = _app(None)
    with TestClient(app) as client:
        yield client, registry


def test_request_id_echoed_when_well_formed_else_replaced(open_client: tuple[TestClient, CollectorRegistry]) -> None:
    client, _ = open_client
    ok = client.post("/echo/a", headers={"X-Request-ID": "run-1.step_2"})
    assert ok.headers["x-request-id"] == ok.json()["request_id"] == "run-1.step_2"  # bound while serving
    for bad in ("has space", "x" * 65, "semi;colon"):
        fresh = client.post("/echo/a", headers={"X-Request-ID": bad}).headers["x-request-id"]
        assert fresh != bad and len(fresh) == 32 and int(fresh, 16) >= 0


def test_body_limit_by_length_and_while_streaming(open_client: tuple[TestClient, CollectorRegistry]) -> None:
    client, _ = open_client
    assert client.post("/echo/a", content=b"x" * 64).status_code == 200
    declared = client.post("/echo/a", content=b"x" * 65)
    assert declared.status_code == 413 and "x-request-id" in declared.headers
    assert declared.json()["detail"] == "request body of 65+ bytes exceeds the limit of 64 bytes (setting max_body)"
    streamed = client.post("/echo/a", content=iter([b"x" * 40, b"y" * 40]))  # chunked: no Content-Length
    assert streamed.status_code == 413 and "limit of 64 bytes" in streamed.json()["detail"]


def test_metrics_use_route_templates_and_access_log_is_json(open_client: tuple[TestClient, CollectorRegistry],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    client, registry = open_client
    with caplog.at_level(logging.INFO, logger="test.access"):
        client.post("/echo/one", headers={"X-Request-ID": "r1"})
        client.post("/echo/two")
        client.get("/nowhere")
    text = generate_latest(registry).decode()
    assert 't_requests_total{method="POST",route="/echo/{name}",status="200"} 2.0' in text
    assert 't_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text
    assert 't_seconds_count{route="/echo/{name}"} 2.0' in text
    first = json.loads(caplog.records[0].getMessage())
    assert {k: first[k] for k in ("event", "request_id", "method", "path", "status")} == \
        {"event": "request", "request_id": "r1", "method": "POST", "path": "/echo/one", "status": 200}
    line = json.loads(JsonFormatter().format(caplog.records[0]))
    assert line["request_id"] == "r1" and line["path"] == "/echo/one" and "msg" not in line


def test_bearer_token() -> None:
    app, _ = _app(SecretStr(TOKEN))
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            refused = client.post("/echo/a", headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert client.post("/echo/a", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_state_and_token_dependencies_run_on_the_event_loop() -> None:
    # FastAPI runs a plain `def` dependency in its thread pool: a thread hand-off per dependency per request, which
    # under 200 concurrent clients was the retriever's largest event-loop cost. These must stay coroutines.
    import inspect

    from sisrl.common.http import app_state

    assert inspect.iscoroutinefunction(app_state("settings", object))
    assert inspect.iscoroutinefunction(bearer_dependency(lambda request: None))


def test_fastapi_native_telemetry_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # FastAPI releases with native OpenTelemetry ask the OpenTelemetry API on every request whether a provider is
    # configured; sisrl's apps turn that off (fastapi_options) unless SISRL_FASTAPI_TELEMETRY=1 or OTEL_* is set.
    import inspect
    import os

    from sisrl.common.http import TELEMETRY_ENV, fastapi_options

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        assert fastapi_options() == {}
        return
    from fastapi.telemetry import _asgi

    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.delenv(TELEMETRY_ENV, raising=False)
    lookups: list[int] = []
    real = _asgi.trace.get_tracer_provider
    monkeypatch.setattr(_asgi.trace, "get_tracer_provider", lambda: lookups.append(1) or real())
    assert not FastAPI(**fastapi_options())._native_telemetry.enabled()
    assert lookups == []  # the per-request check costs nothing
    assert not FastAPI()._native_telemetry.enabled() and lookups  # FastAPI's default looks the provider up
    monkeypatch.setenv(TELEMETRY_ENV, "1")
    assert fastapi_options() == {}
    monkeypatch.delenv(TELEMETRY_ENV)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "retriever")
    assert fastapi_options() == {}
