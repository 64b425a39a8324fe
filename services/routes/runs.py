"""`/v1/runs`: per-step statistics of a training run's rollouts."""

from __future__ import annotations

from fastapi import APIRouter
from sisrl.services import store
from sisrl.services.deps import SessionDep
from sisrl.services.schemas import RunStats

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.get("/{run}/stats", response_model=RunStats, summary="Per-step reward, EM per source, searches, lengths")
def run_stats(run: str, session: SessionDep) -> RunStats:
    data = store.run_stats(session=session, run=run)
    return RunStats(run=run, data=data, count=len(data))
