"""`/health` (never behind the token) and `/metrics` (Prometheus text, behind the token when one is set)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sisrl.services.engines.openai_server.deps import EngineDep, MetricsDep, SettingsDep
from sisrl.services.engines.openai_server.schemas import Health

router = APIRouter(tags=["health"])
metrics_router = APIRouter(tags=["metrics"])


@router.get("/health", response_model=Health)
async def health(engine: EngineDep, settings: SettingsDep) -> Health:
    return Health(model=settings.served_name, policy_version=engine.policy_version)


@metrics_router.get("/metrics", response_class=Response)
async def prometheus(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
