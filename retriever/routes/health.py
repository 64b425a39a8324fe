"""GET /health: liveness and what is loaded (used by the Docker healthcheck and test start-up waits)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sisrl.retriever.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health)
async def health(request: Request) -> Health:
    searcher = request.app.state.service.searcher
    return Health(status="ok", passages=searcher.manifest.count, dim=searcher.manifest.dim,
                  encoder=searcher.manifest.encoder.model, index_type=searcher.manifest.index_type,
                  startup_seconds=round(request.app.state.startup_seconds, 3))
