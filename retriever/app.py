"""`create_app(settings)`: the retrieval server. The encoder and index load in the lifespan, not at import."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sisrl.common.admission import AdmissionGate
from sisrl.common.http import ServiceMiddleware, fastapi_options
from sisrl.common.openapi import fit_openapi
from sisrl.retriever.encode_procs import EncoderProcesses
from sisrl.retriever.metrics import Metrics
from sisrl.retriever.routes import health, metrics, retrieve
from sisrl.retriever.searcher import SearcherOptions, encoder_config, open_searcher
from sisrl.retriever.service import RetrievalService, ServiceOptions
from sisrl.retriever.settings import Settings

logger = logging.getLogger(__name__)


def encode_plan(settings: Settings) -> tuple[int, int]:
    """(encoder worker threads, intra-op threads of each) for `--encode-workers` / `--torch-threads`, 0 = auto.

    On a CPU, one worker per core with one intra-op thread each beat one worker with a team of one thread per
    core, torch and ONNX Runtime alike: no OpenMP barrier waits for a thread the event loop has descheduled
    (bench/retriever.py; figures: docs/results.md). A GPU gets one worker."""
    gpu = settings.device not in ("auto", "cpu") or settings.faiss_gpu
    workers = settings.encode_workers or (1 if gpu else len(os.sched_getaffinity(0)))
    threads = settings.torch_threads or (1 if workers > 1 else 0)
    return workers, threads


def searcher_options(settings: Settings) -> SearcherOptions:
    return SearcherOptions(encoder=settings.encoder, dtype=settings.dtype, device=settings.device,
                           backend=settings.backend, threads=encode_plan(settings)[1],
                           encode_batch_size=settings.encode_batch_size, trace=settings.trace, pack=settings.pack,
                           faiss_gpu=settings.faiss_gpu,
                           mmap_index=settings.mmap_index, nprobe=settings.nprobe, ef_search=settings.ef_search,
                           rerank=settings.rerank)


def service_options(settings: Settings, workers: int) -> ServiceOptions:
    return ServiceOptions(dedupe=settings.dedupe, cache_size=settings.cache_size, coalesce_ms=settings.coalesce_ms,
                          coalesce_early=settings.coalesce_early,
                          max_batch_queries=settings.max_batch_queries,
                          pipeline_queries=settings.pipeline_queries, offload=settings.offload,
                          overlap=settings.overlap, fifo_window=settings.fifo_window,
                          max_query_chars=settings.max_query_chars, encode_workers=workers)


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
        workers, threads = encode_plan(settings)
        if searcher.encoder.device != "cpu":  # `--device auto` found a GPU: one stream of batches
            workers = settings.encode_workers or 1
        processes = None
        if settings.encode_processes and searcher.encoder.device == "cpu":
            cfg = encoder_config(searcher.manifest, searcher_options(settings))
            try:
                processes = await asyncio.to_thread(EncoderProcesses, cfg, settings.encode_processes,
                                                    threads=settings.torch_threads or 1)
            except RuntimeError as exc:
                searcher.close()
                logger.error("cannot start the retriever: %s", exc)
                raise
        service = RetrievalService(searcher, service_options(settings, workers), metrics_registry, processes)
        await service.start()
        app.state.service = service
        app.state.startup_seconds = time.perf_counter() - started
        if processes is not None:
            logger.info("retriever ready in %.2fs on index %s; %d encoder process(es) x %d intra-op thread(s)",
                        app.state.startup_seconds, settings.index, processes.processes, settings.torch_threads or 1)
        else:
            logger.info("retriever ready in %.2fs on index %s; %d encoder worker(s) x %s intra-op thread(s)",
                        app.state.startup_seconds, settings.index, workers, threads or "default")
        try:
            yield
        finally:
            await service.stop()
            searcher.close()

    app = FastAPI(title="sisrl retriever", version="0.1.0", lifespan=lifespan, **fastapi_options(),
                  description="E5 + FAISS dense retrieval with Search-R1's /retrieve contract.")
    app.state.settings = settings
    app.state.metrics = metrics_registry
    app.state.admission = AdmissionGate(max_in_flight=settings.max_in_flight, max_queued=settings.max_queued,
                                        timeout_s=settings.request_timeout_s, registry=metrics_registry.registry,
                                        prefix="sisrl_retriever")
    app.include_router(retrieve.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    fit_openapi(app, token_set=settings.api_token is not None)
    app.add_middleware(ServiceMiddleware, metrics=metrics_registry.http, max_body=settings.max_body_bytes,
                       limit_setting="max_body_bytes", access_log=logging.getLogger("sisrl.retriever.access"))
    return app
