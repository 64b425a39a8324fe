"""`create_app(settings)`: the rollout gateway's FastAPI application (resources open in the lifespan)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sisrl.common.http import ServiceMiddleware
from sisrl.common.openapi import fit_openapi
from sisrl.services.deps import TokenDep
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.routes import batches, health, policy, rollouts, runs
from sisrl.services.settings import GatewaySettings
from sisrl.services.state import close_state, open_state
from sisrl.services.timing import BusyClock


def create_app(settings: GatewaySettings) -> FastAPI:
    clock = BusyClock()
    metrics = GatewayMetrics(clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.gateway = await open_state(settings, clock=clock, metrics=metrics)
        try:
            yield
        finally:
            await close_state(app.state.gateway)

    app = FastAPI(title="sisrl rollout gateway", version="0.1.0", lifespan=lifespan,
                  description="Multi-turn search-agent rollouts, rewards and a queryable rollout store.")
    app.add_middleware(ServiceMiddleware, metrics=metrics.http, max_body=settings.max_request_bytes,
                       limit_setting="max_request_bytes", access_log=logging.getLogger("sisrl.services.access"))
    app.include_router(health.router)
    app.include_router(health.metrics_router)
    for module in (rollouts, batches, runs, policy):
        app.include_router(module.router, dependencies=[TokenDep])
    fit_openapi(app, token_set=settings.api_token is not None)
    return app
