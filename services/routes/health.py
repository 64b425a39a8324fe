"""`/health` (never behind the token) and `/metrics` (Prometheus text, behind the token when one is set)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sisrl.services.deps import StateDep, TokenDep
from sisrl.services.schemas import Health, RolloutSettings

router = APIRouter(tags=["health"])
metrics_router = APIRouter(tags=["metrics"], dependencies=[TokenDep])


@router.get("/health", response_model=Health, summary="Liveness and the loaded policy version")
def health(state: StateDep) -> Health:
    live, settings = state.live, state.settings
    rollout = RolloutSettings(topk=settings.topk, observation_max_tokens=settings.observation_max_tokens,
                              max_response_tokens=settings.max_response_tokens,
                              format_weight=settings.format_weight) if live else None
    return Health(status="ok", policy_version=live.engine.policy_version if live else None,
                  engine=settings.engine if live else "store-only", inflight_trajectories=state.pending,
                  load_granularity=live.runner.gate.granularity if live else None,
                  weights_dtype=live.weights_dtype if live else None,
                  store_only=live is None, token_required=settings.api_token is not None, rollout=rollout)


@metrics_router.get("/metrics", response_model=None, response_class=Response, summary="Prometheus metrics",
                    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
