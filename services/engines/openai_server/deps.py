"""Dependencies of the route handlers, as Annotated aliases: the engine, the settings, the metrics, the token."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends
from sisrl.common.admission import AdmissionGate
from sisrl.common.http import app_state, bearer_dependency
from sisrl.services.engines.local import LocalEngine
from sisrl.services.engines.openai_server.metrics import EngineMetrics
from sisrl.services.engines.openai_server.settings import ServerSettings

get_engine = app_state("engine", LocalEngine)
get_settings = app_state("settings", ServerSettings)
get_metrics = app_state("metrics", EngineMetrics)
get_admission = app_state("admission", AdmissionGate)


EngineDep = Annotated[LocalEngine, Depends(get_engine)]
SettingsDep = Annotated[ServerSettings, Depends(get_settings)]
MetricsDep = Annotated[EngineMetrics, Depends(get_metrics)]
AdmissionDep = Annotated[AdmissionGate, Depends(get_admission)]  # caps, deadline, cancel on disconnect
# 401 unless `Authorization: Bearer <token>` matches $SISRL_ENGINE_API_TOKEN (no check when it is unset).
TokenDep = Depends(bearer_dependency(lambda request: cast(ServerSettings, request.app.state.settings).api_token))
