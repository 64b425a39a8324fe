"""Make a service's OpenAPI document say what the running configuration does.

FastAPI documents a bearer dependency as required security on every route that has it, whether or not a token
is configured; without a token those routes answer 200 to anyone, so the document would be false (schemathesis
ST401 / ST203). And the 401 a route answers with a token set, the 400/413 of an unparsable or oversized body and
the 404 of a lookup by id are statuses a client must be told about (ST103).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

_UNAUTHORIZED = {"description": "missing or wrong bearer token (`WWW-Authenticate: Bearer`)"}
_TOO_LARGE = {"description": "request body over the size limit"}
_UNPARSABLE = {"description": "request body that cannot be parsed (not UTF-8 / not JSON)"}
_NOT_FOUND = {"description": "no resource with this id"}


def fit_openapi(app: FastAPI, *, token_set: bool, body_limit: bool = True) -> None:
    """Replace `app.openapi` by a cached builder that keeps bearer security (and lists 401) only when
    `token_set`, and lists 400 (unparsable body) and, with `body_limit`, 413 on every operation with a body."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _fitted(build(), token_set=token_set, body_limit=body_limit)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_exception_handler(StarletteHTTPException, _allow_every_method)  # type: ignore[arg-type]


async def _allow_every_method(request: Request, exc: StarletteHTTPException) -> Response:
    """A 405 names every method of the path in `Allow` (RFC 9110, 15.5.6). Starlette names only those of the
    first route that matched, so GET and POST on one path served by two routes would each deny the other."""
    if exc.status_code == 405:
        path = request.url.path
        methods = sorted({m for route in request.app.routes if isinstance(route, Route) and route.methods
                          and route.path_regex.match(path) for m in route.methods})
        exc = StarletteHTTPException(405, detail=exc.detail, headers={**(exc.headers or {}), "Allow": ", ".join(methods)})
    return await http_exception_handler(request, exc)


def _fitted(schema: dict[str, Any], *, token_set: bool, body_limit: bool) -> dict[str, Any]:
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            if not isinstance(operation, dict):
                continue
            responses = operation.setdefault("responses", {})
            if operation.get("security"):
                if token_set:
                    responses.setdefault("401", _UNAUTHORIZED)
                else:
                    del operation["security"]
            if any(p.get("in") == "path" for p in operation.get("parameters", [])):
                responses.setdefault("404", _NOT_FOUND)  # a path parameter names a resource that may not exist
            if "requestBody" in operation:
                responses.setdefault("400", _UNPARSABLE)
                if body_limit:
                    responses.setdefault("413", _TOO_LARGE)
    if not token_set:
        schema.get("components", {}).pop("securitySchemes", None)
    return schema
