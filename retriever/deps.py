"""FastAPI dependencies: the app's state objects and the optional bearer-token check."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sisrl.retriever.metrics import Metrics
from sisrl.retriever.service import RetrievalService
from sisrl.retriever.settings import Settings

_bearer = HTTPBearer(auto_error=False)


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_service(request: Request) -> RetrievalService:
    service: RetrievalService = request.app.state.service
    return service


def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def require_token(settings: Annotated[Settings, Depends(get_settings)],
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """When `api_token` is set, demand `Authorization: Bearer <token>` (compared in constant time)."""
    if settings.api_token is None:
        return
    expected = settings.api_token.get_secret_value()
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise HTTPException(401, detail="missing or wrong bearer token (header 'Authorization: Bearer <token>')",
                            headers={"WWW-Authenticate": "Bearer"})


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[RetrievalService, Depends(get_service)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
Authorized = Depends(require_token)
