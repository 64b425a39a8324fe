"""FastAPI dependencies: the app's state objects and the optional bearer-token check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sisrl.common.http import bearer_dependency
from sisrl.retriever.metrics import Metrics
from sisrl.retriever.service import RetrievalService
from sisrl.retriever.settings import Settings


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_service(request: Request) -> RetrievalService:
    service: RetrievalService = request.app.state.service
    return service


def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


# When `api_token` is set, demand `Authorization: Bearer <token>` (sisrl.common.http).
require_token = bearer_dependency(lambda request: get_settings(request).api_token)


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[RetrievalService, Depends(get_service)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
Authorized = Depends(require_token)
