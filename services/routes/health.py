"""`/health` (never behind the token) and `/metrics` (Prometheus text, behind the token when one is set)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sisrl.services.deps import StateDep, TokenDep
from sisrl.services.schemas import Health

router = APIRouter(tags=["health"])
metrics_router = APIRouter(tags=["metrics"], dependencies=[TokenDep])


@router.get("/health", response_model=Health, summary="Liveness and the loaded policy version")
def health(state: StateDep) -> Health:
    return Health(status="ok", policy_version=state.engine.policy_version, engine=state.settings.engine,
                  inflight_trajectories=state.runner.pending)


@metrics_router.get("/metrics", response_model=None, response_class=Response, summary="Prometheus metrics",
                    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
