"""`GET /v1/models`: the one served model."""

from __future__ import annotations

from fastapi import APIRouter
from sisrl.services.engines.openai_server.deps import SettingsDep
from sisrl.services.engines.openai_server.schemas import ModelCard, ModelList

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ModelList)
async def models(settings: SettingsDep) -> ModelList:
    return ModelList(data=[ModelCard(id=settings.served_name)])
