"""`create_app(settings)`: the retrieval server. The encoder and index load in the lifespan, not at import."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sisrl.common.http import ServiceMiddleware
from sisrl.common.openapi import fit_openapi
from sisrl.retriever.metrics import Metrics
from sisrl.retriever.routes import health, metrics, retrieve
from sisrl.retriever.searcher import SearcherOptions, open_searcher
from sisrl.retriever.service import RetrievalService, ServiceOptions
from sisrl.retriever.settings import Settings

logger = logging.getLogger(__name__)


def searcher_options(settings: Settings) -> SearcherOptions:
    return SearcherOptions(encoder=settings.encoder, dtype=settings.dtype, device=settings.device,
                           backend=settings.backend, threads=settings.torch_threads,
                           encode_batch_size=settings.encode_batch_size, faiss_gpu=settings.faiss_gpu,
                           mmap_index=settings.mmap_index, nprobe=settings.nprobe, ef_search=settings.ef_search,
                           rerank=settings.rerank)


def service_options(settings: Settings) -> ServiceOptions:
    return ServiceOptions(dedupe=settings.dedupe, cache_size=settings.cache_size, coalesce_ms=settings.coalesce_ms,
                          max_batch_queries=settings.max_batch_queries, offload=settings.offload,
                          max_query_chars=settings.max_query_chars, encode_workers=settings.encode_workers)


def create_app(settings: Settings) -> FastAPI:
    metrics_registry = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started = time.perf_counter()
        # A wrong or corrupt index raises here, so the server never starts listening (fail fast).
        try:
            searcher = open_searcher(settings.index, searcher_options(settings))
        except (ValueError, FileNotFoundError) as exc:
            logger.error("cannot start the retriever: %s", exc)
            raise
        service = RetrievalService(searcher, service_options(settings), metrics_registry)
        await service.start()
        app.state.service = service
        app.state.startup_seconds = time.perf_counter() - started
        logger.info("retriever ready in %.2fs on index %s", app.state.startup_seconds, settings.index)
        try:
            yield
        finally:
            await service.stop()
            searcher.close()

    app = FastAPI(title="sisrl retriever", version="0.1.0", lifespan=lifespan,
                  description="E5 + FAISS dense retrieval with Search-R1's /retrieve contract.")
    app.state.settings = settings
    app.state.metrics = metrics_registry
    app.include_router(retrieve.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    fit_openapi(app, token_set=settings.api_token is not None)
    app.add_middleware(ServiceMiddleware, metrics=metrics_registry.http, max_body=settings.max_body_bytes,
                       limit_setting="max_body_bytes", access_log=logging.getLogger("sisrl.retriever.access"))
    return app
