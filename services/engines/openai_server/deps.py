"""Dependencies of the route handlers, as Annotated aliases: the engine, the settings, the metrics, the token."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sisrl.common.http import bearer_dependency
from sisrl.services.engines.local import LocalEngine
from sisrl.services.engines.openai_server.metrics import EngineMetrics
from sisrl.services.engines.openai_server.settings import ServerSettings


def get_engine(request: Request) -> LocalEngine:
    engine: LocalEngine = request.app.state.engine
    return engine


def get_settings(request: Request) -> ServerSettings:
    settings: ServerSettings = request.app.state.settings
    return settings


def get_metrics(request: Request) -> EngineMetrics:
    metrics: EngineMetrics = request.app.state.metrics
    return metrics


EngineDep = Annotated[LocalEngine, Depends(get_engine)]
SettingsDep = Annotated[ServerSettings, Depends(get_settings)]
MetricsDep = Annotated[EngineMetrics, Depends(get_metrics)]
# 401 unless `Authorization: Bearer <token>` matches $SISRL_ENGINE_API_TOKEN (no check when it is unset).
TokenDep = Depends(bearer_dependency(lambda request: get_settings(request).api_token))
