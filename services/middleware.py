"""ASGI middleware: request ids, JSON access logs, request metrics and the request body size limit."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from typing import Any

from sisrl.services.metrics import GatewayMetrics
from starlette.types import ASGIApp, Message, Receive, Scope, Send

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_VALID_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
log = logging.getLogger("sisrl.services.access")


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the request id of the request being served."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
            "request_id": request_id_var.get(), "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class _TooLarge(Exception):
    pass


class GatewayMiddleware:
    """Sets X-Request-ID, logs and counts each request, refuses bodies over `max_body` bytes with 413."""

    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics, max_body: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        rid = given if _VALID_ID.match(given) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        start = time.perf_counter()
        status = {"code": 500, "started": False}

        async def send_wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", rid.encode())]
            await send(message)

        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise _TooLarge
            return message

        try:
            length = headers.get("content-length", "0")
            if not length.isdigit() or int(length) > self.max_body:
                raise _TooLarge
            await self.app(scope, receive_limited, send_wrapped)
        except _TooLarge:
            if status["started"]:
                raise
            await _send_json(send_wrapped, 413, {"detail": f"request body exceeds {self.max_body} bytes"})
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            elapsed = time.perf_counter() - start
            self.metrics.requests.labels(scope["method"], path, str(status["code"])).inc()
            self.metrics.request_seconds.labels(path).observe(elapsed)
            log.info("request", extra={"fields": {
                "method": scope["method"], "path": scope["path"], "status": status["code"],
                "ms": round(elapsed * 1000, 2),
            }})
            request_id_var.reset(token)


async def _send_json(send: Send, code: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
