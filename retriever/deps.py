"""FastAPI dependencies: the app's state objects and the optional bearer-token check."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends
from sisrl.common.admission import AdmissionGate
from sisrl.common.http import app_state, bearer_dependency
from sisrl.retriever.metrics import Metrics
from sisrl.retriever.service import RetrievalService
from sisrl.retriever.settings import Settings

get_settings = app_state("settings", Settings)
get_service = app_state("service", RetrievalService)
get_metrics = app_state("metrics", Metrics)
get_admission = app_state("admission", AdmissionGate)


# When `api_token` is set, demand `Authorization: Bearer <token>` (sisrl.common.http).
require_token = bearer_dependency(lambda request: cast(Settings, request.app.state.settings).api_token)


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[RetrievalService, Depends(get_service)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
AdmissionDep = Annotated[AdmissionGate, Depends(get_admission)]  # in-flight / queue caps, deadline (common.admission)
Authorized = Depends(require_token)
