"""The HTTP layer every sisrl service shares (docs/design.md, "Cross-cutting rules"): request ids, one JSON
access-log line per request, Prometheus request metrics, the request body limit, and the optional bearer token.

Rules, the same for the retriever, the gateway and the policy server:
- `X-Request-ID`: the client's value when it matches `[A-Za-z0-9._-]{1,64}`, else a new 32-hex id; echoed in
  the response headers and bound to `request_id_var` while the request runs (log lines carry it).
- Metrics: `<requests>_total{method,route,status}` and `<latency>{route}`; `route` is the route template
  (`/v1/rollouts/{trajectory_id}`), `unmatched` for 404s, so label values stay bounded.
- Body limit: 413 when Content-Length or the streamed body (chunked) exceeds `max_body` bytes.
- Bearer token: 401 with `WWW-Authenticate: Bearer` unless `Authorization: Bearer <token>` matches
  (constant-time compare); no check when no token is configured.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import logging
import os
import random
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar, cast

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import SecretStr
from starlette.types import ASGIApp, Message, Receive, Scope, Send

T = TypeVar("T")
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_VALID_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, the request id being served, and the message (or the
    record's `fields`, which access-log lines carry)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                                 "logger": record.name, "request_id": request_id_var.get()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        else:
            entry["msg"] = record.getMessage()
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str) -> None:
    """Route every logger through one stderr handler writing `JsonFormatter` lines at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RequestMetrics:
    """The request counter and latency histogram of one service, in its own registry's namespace."""

    def __init__(self, registry: CollectorRegistry, *, requests: str, latency: str) -> None:
        self.requests = Counter(requests, "HTTP requests by method, route template and status code",
                                ["method", "route", "status"], registry=registry)
        self.latency = Histogram(latency, "HTTP request latency, seconds", ["route"], registry=registry,
                                 buckets=LATENCY_BUCKETS)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(route).observe(seconds)


def request_id(headers: dict[bytes, bytes]) -> str:
    """The client's `X-Request-ID` when well-formed, else a fresh one."""
    given = headers.get(b"x-request-id", b"").decode("latin-1")
    # A random 128-bit id needs no kernel entropy: uuid4 reads os.urandom on every request.
    return given if _VALID_ID.match(given) else f"{random.getrandbits(128):032x}"


TELEMETRY_ENV = "SISRL_FASTAPI_TELEMETRY"


def fastapi_options() -> dict[str, Any]:
    """Keyword arguments every sisrl FastAPI app is built with.

    FastAPI releases with native OpenTelemetry (a `telemetry` argument) ask the OpenTelemetry API on every request
    whether a tracer, meter or logger provider is configured, reading environment variables each time: ~11 % of
    the retriever's event-loop time under 200 one-query clients (py-spy). Turned off here unless
    `SISRL_FASTAPI_TELEMETRY=1` or an `OTEL_*` variable is set; {} on releases without the argument."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    if os.environ.get(TELEMETRY_ENV) == "1" or any(key.startswith("OTEL_") for key in os.environ):
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


class ServiceMiddleware:
    """Pure ASGI middleware: request id, body limit, metrics and one access-log line per HTTP request.

    `limit_setting` names the option that sets `max_body` (it appears in the 413 detail).
    """

    def __init__(self, app: ASGIApp, *, metrics: RequestMetrics, max_body: int, limit_setting: str,
                 access_log: logging.Logger) -> None:
        self.app, self.metrics, self.max_body = app, metrics, max_body
        self.limit_setting, self.access_log = limit_setting, access_log

    def _detail(self, size: int) -> str:
        return (f"request body of {size}+ bytes exceeds the limit of {self.max_body} bytes "
                f"(setting {self.limit_setting})")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = request_id(headers)
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        received = 0

        async def limited_receive() -> Message:
            # A chunked body has no Content-Length: count while it streams. FastAPI re-raises an HTTPException
            # from body reading as is, so the client gets this 413 rather than a generic 400.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise HTTPException(413, detail=self._detail(received))
            return message

        try:
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_body:
                await _send_json(send_with_id, 413, {"detail": self._detail(int(declared))})
            else:
                await self.app(scope, limited_receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe(scope["method"], route, status, elapsed)
            if self.access_log.isEnabledFor(logging.INFO):  # a line built per request only when it is written
                entry = {"event": "request", "request_id": rid, "method": scope["method"], "path": scope["path"],
                         "status": status, "latency_ms": round(elapsed * 1000, 3)}
                self.access_log.info(json.dumps(entry), extra={"fields": entry})
            request_id_var.reset(token)


async def _send_json(send: Send, code: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def app_state(name: str, kind: type[T]) -> Callable[[Request], Awaitable[T]]:
    """A dependency returning `request.app.state.<name>` (set by `create_app` or its lifespan) as a `kind`.

    `async def`, like every cheap dependency here: FastAPI runs a plain `def` dependency in its thread pool, a
    thread hand-off per dependency per request (under 200 concurrent clients that was the retriever's event loop's
    largest cost)."""

    async def get(request: Request) -> T:
        return cast(T, getattr(request.app.state, name))

    get.__name__ = f"get_{name}"
    return get


_bearer = HTTPBearer(auto_error=False, description="the service's API token (when one is set)")


def bearer_dependency(expected: Callable[[Request], SecretStr | None]) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency that demands `Authorization: Bearer <token>` when `expected(request)` is a token."""

    async def require_token(request: Request,
                            credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        token = expected(request)
        if token is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(given.encode(), token.get_secret_value().encode()):
            raise HTTPException(401, detail="missing or wrong bearer token (header 'Authorization: Bearer <token>')",
                                headers={"WWW-Authenticate": "Bearer"})

    return require_token
