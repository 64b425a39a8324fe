"""GET /metrics: Prometheus text exposition of this server's registry."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sisrl.retriever.deps import Authorized, MetricsDep

router = APIRouter(tags=["metrics"], dependencies=[Authorized])


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus metrics"}})
async def metrics(metrics: MetricsDep) -> PlainTextResponse:
    return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
