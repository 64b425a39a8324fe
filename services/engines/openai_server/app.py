"""`create_app(settings)`: the policy server's FastAPI application (the engine loads in the lifespan)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import FastAPI
from sisrl.common.admission import AdmissionGate
from sisrl.common.http import ServiceMiddleware, fastapi_options
from sisrl.common.openapi import fit_openapi
from sisrl.services.engines.local import LocalEngine
from sisrl.services.engines.openai_server.deps import TokenDep
from sisrl.services.engines.openai_server.metrics import EngineMetrics
from sisrl.services.engines.openai_server.routes import completions, health, models, weights
from sisrl.services.engines.openai_server.settings import ServerSettings


def create_app(settings: ServerSettings, engine: LocalEngine | None = None) -> FastAPI:
    """The server app. The engine loads in the lifespan unless one is given (then the caller owns it)."""
    metrics = EngineMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:  # given by the caller, who also closes it
            yield
            return
        app.state.engine = await asyncio.to_thread(
            LocalEngine,
            settings.model,
            max_batch_size=settings.max_batch_size,
            dtype=settings.dtype,
            num_threads=settings.threads or None,
        )
        yield
        await app.state.engine.close()

    app = FastAPI(title="sisrl OpenAI-compatible policy server", version="0.1.0", lifespan=lifespan,
                  **fastapi_options())
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.admission = AdmissionGate(max_in_flight=settings.max_in_flight, max_queued=settings.max_queued,
                                        timeout_s=settings.request_timeout_s, registry=metrics.registry,
                                        prefix="sisrl_engine")
    metrics.watch(lambda: cast(LocalEngine | None, app.state.engine))
    app.add_middleware(ServiceMiddleware, metrics=metrics.http, max_body=settings.max_body_bytes,
                       limit_setting="max_body_bytes", access_log=logging.getLogger("sisrl.services.engines.access"))
    app.include_router(health.router)
    for module in (completions, weights, models):
        app.include_router(module.router, dependencies=[TokenDep])
    app.include_router(health.metrics_router, dependencies=[TokenDep])
    fit_openapi(app, token_set=settings.api_token is not None)
    _state_the_caps(app, settings)
    return app


def _state_the_caps(app: FastAPI, settings: ServerSettings) -> None:
    """The served schema carries this server's `--max-tokens` and `--max-logprobs` as the fields' maxima, so a
    body the document calls valid is not refused for them."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
        for name, cap in (("max_tokens", settings.max_tokens), ("logprobs", settings.max_logprobs)):
            for variant in fields[name].get("anyOf", [fields[name]]):
                if variant.get("type") == "integer":
                    variant["maximum"] = cap
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
