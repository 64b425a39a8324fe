"""`create_app(settings)`: the rollout gateway's FastAPI application (resources open in the lifespan)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from sisrl.common.http import ServiceMiddleware, fastapi_options
from sisrl.common.openapi import fit_openapi
from sisrl.services.deps import TokenDep, get_live
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.routes import batches, health, policy, rollouts, runs, sis, ui
from sisrl.services.settings import GatewaySettings
from sisrl.services.state import close_state, open_state
from sisrl.services.timing import BusyClock


def create_app(settings: GatewaySettings) -> FastAPI:
    clock = BusyClock()
    metrics = GatewayMetrics(clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            app.state.gateway = await open_state(settings, clock=clock, metrics=metrics)
        except Exception as exc:  # one line with the cause before uvicorn's traceback ("startup failed")
            logging.getLogger("sisrl.services.app").error("cannot start the gateway: %s",
                                                          " ".join(str(exc).split()) or type(exc).__name__)
            raise
        try:
            yield
        finally:
            await close_state(app.state.gateway)

    app = FastAPI(title="sisrl rollout gateway", version="0.1.0", lifespan=lifespan, **fastapi_options(),
                  description="Multi-turn search-agent rollouts, rewards, a queryable rollout store with the "
                              "trainer's SIS records, and a viewer at /ui.")
    app.add_middleware(ServiceMiddleware, metrics=metrics.http, max_body=settings.max_request_bytes,
                       limit_setting="max_request_bytes", access_log=logging.getLogger("sisrl.services.access"))
    app.include_router(health.router)
    app.include_router(health.metrics_router)
    api = [module.router for module in (rollouts, batches, runs, sis, policy)]
    for router in api:
        app.include_router(router, dependencies=[TokenDep])
    app.include_router(ui.router)  # static, no data: the page itself asks for the token
    if settings.store_only:
        _hide_engine_routes(app, api)
    fit_openapi(app, token_set=settings.api_token is not None)
    return app


def _needs_engine(dependant: Dependant) -> bool:
    return any(d.call is get_live or _needs_engine(d) for d in dependant.dependencies)


def _hide_engine_routes(app: FastAPI, routers: list[APIRouter]) -> None:
    """Store-only: the operations that need the engine answer 503 and are left out of the OpenAPI document,
    which describes what this configuration serves (as `fit_openapi` does for the token)."""
    hidden = {(route.path, method.lower()) for router in routers for route in router.routes
              if isinstance(route, APIRoute) and _needs_engine(route.dependant) for method in route.methods or ()}
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        paths = schema.get("paths", {})
        for path, method in hidden:
            paths.get(path, {}).pop(method, None)
            if path in paths and not paths[path]:
                del paths[path]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
