"""`/v1/runs`: the runs in the store, and per run its per-step rollout and SIS statistics and SIS token counts."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sisrl.services import sis_store, store
from sisrl.services.deps import SessionDep, StateDep
from sisrl.services.schemas import RunList, RunStats, SisRunStats, SisTokens

router = APIRouter(prefix="/v1/runs", tags=["runs"])
MAX_STEP = 2**62  # as in routes/rollouts.py: a larger filter is a 422, not a database overflow


@router.get("", response_model=RunList, summary="Runs with stored trajectories, newest first")
def list_runs(session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> RunList:
    data = store.list_runs(session=session, limit=limit)
    return RunList(data=data, count=len(data))


@router.get("/{run}/stats", response_model=RunStats, summary="Per-step reward, EM per source, searches, lengths")
def run_stats(run: str, session: SessionDep) -> RunStats:
    data = store.run_stats(session=session, run=run)
    return RunStats(run=run, data=data, count=len(data))


@router.get("/{run}/sis_stats", response_model=SisRunStats,
            summary="Per trainer step: SIS accept rate, outside-V_K tokens, mean D and D_SIS")
def sis_stats(run: str, session: SessionDep) -> SisRunStats:
    data = sis_store.step_stats(session=session, run=run)
    return SisRunStats(run=run, data=data, count=len(data))


@router.get("/{run}/sis_tokens", response_model=SisTokens,
            summary="Tokens most often accepted and most often rejected by SIS (paper, Fig. 5)")
def sis_tokens(
    run: str, state: StateDep, session: SessionDep,
    step_min: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    top: Annotated[int, Query(ge=1, le=200, description="entries per list")] = 30,
    max_records: Annotated[int, Query(ge=1, le=20000, description="newest records read")] = 2000,
) -> SisTokens:
    decode = state.texts.pieces if state.texts is not None else None
    return sis_store.token_counts(session=session, run=run, step_min=step_min, step_max=step_max,
                                  max_records=max_records, top=top, decode=decode)
