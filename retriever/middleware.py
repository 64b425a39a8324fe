"""ASGI middleware: request ids + one structured log line per request + metrics, and the body-size limit."""

from __future__ import annotations

import json
import logging
import time
import uuid

from sisrl.retriever.metrics import Metrics
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("sisrl.retriever.access")


class RequestLogMiddleware:
    """Give each request an id (the client's `X-Request-ID`, else a new one), echo it in the response headers,
    log `{"event": "request", request_id, method, path, status, latency_ms}` and count it in the metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            route = scope["path"] if scope["path"] in ("/retrieve", "/health", "/metrics") else "other"
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            self.metrics.latency.labels(route=route).observe(elapsed)
            access_log.info(json.dumps({"event": "request", "request_id": request_id, "method": scope["method"],
                                        "path": scope["path"], "status": status,
                                        "latency_ms": round(elapsed * 1000, 3)}))


class BodyLimitMiddleware:
    """Answer 413 when a body is larger than `max_bytes`, by Content-Length or while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, int(declared))
            return
        received = 0

        async def limited_receive() -> Message:
            # A chunked body has no Content-Length: count while it streams. FastAPI re-raises HTTPException
            # from body reading as is, so the client gets this 413 rather than a generic 400.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, detail=self._detail(received))
            return message

        await self.app(scope, limited_receive, send)

    def _detail(self, size: int) -> str:
        return f"request body of {size}+ bytes exceeds the limit of {self.max_bytes} bytes (setting max_body_bytes)"

    async def _reject(self, send: Send, size: int) -> None:
        body = json.dumps({"detail": self._detail(size)}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
