"""`/v1/rollouts`: submit a batch of rollouts; list and read stored trajectories (with their SIS record)."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.concurrency import run_in_threadpool
from sisrl.services import sis_store, store
from sisrl.services.deps import STORE_ONLY_RESPONSE, LiveDep, SessionDep, StateDep
from sisrl.services.schemas import (
    BatchCreated,
    FinishReason,
    RolloutCreate,
    RolloutPage,
    TrajectoryDetail,
    TrajectoryTexts,
)
from sisrl.services.state import GatewayState, Live
from sqlalchemy.orm import Session

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"])
MAX_STEP = 2**62  # steps are stored as 64-bit integers; a larger filter value is a 422, not a database overflow
log = logging.getLogger(__name__)


def _reserve(state: GatewayState, live: Live, n: int) -> None:
    limit = state.settings.max_pending
    if n > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                            detail=f"batch of {n} trajectories exceeds max_pending={limit}; split it")
    if live.runner.pending + n > limit:
        state.metrics.rejected.inc()
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, headers={"Retry-After": "1"},
                            detail=f"{live.runner.pending} trajectories pending, {n} more exceed max_pending={limit}")


def _all_pairs(body: RolloutCreate) -> list[tuple[int, int]]:
    return [(i, s) for i in range(len(body.items)) for s in range(body.samples_per_item)]


async def _resume(state: GatewayState, live: Live, row: store.BatchRow, body: RolloutCreate) -> BatchCreated:
    """Same idempotency key again: finished or running batches are returned; interrupted ones resume."""
    if live.runner.is_running(row.id) or row.status in ("done", "failed"):
        return BatchCreated(batch_id=row.id, status="running" if live.runner.is_running(row.id) else row.status)  # type: ignore[arg-type]

    def missing() -> list[tuple[int, int]]:
        with state.sessions() as session:
            done = store.done_samples(session=session, batch_id=row.id)
        return [(i, s) for i, s in _all_pairs(body) if (body.items[i].id, s) not in done]

    todo = await run_in_threadpool(missing)
    _reserve(state, live, len(todo))
    await run_in_threadpool(_set_status, state, row.id, "running")
    live.runner.start(batch_id=row.id, request=body, todo=todo)
    return BatchCreated(batch_id=row.id, status="running")


def _set_status(state: GatewayState, batch_id: str, value: str) -> None:
    with state.sessions() as session:
        store.set_batch_status(session=session, batch_id=batch_id, status=value)


@router.post("", response_model=BatchCreated, summary="Submit a batch of rollouts",
             responses={409: {"description": "idempotency_key already used for another request"},
                        413: {"description": "more trajectories than max_pending in one batch"},
                        429: {"description": "the gateway has max_pending trajectories queued; retry after Retry-After"},
                        **STORE_ONLY_RESPONSE})
async def create_rollouts(body: RolloutCreate, state: StateDep, live: LiveDep) -> BatchCreated:
    """Start `samples_per_item` trajectories per item. A repeated `idempotency_key` never duplicates work:
    it returns the same batch, and an interrupted batch runs only its missing samples."""
    if body.policy_version != live.engine.policy_version:
        log.warning("batch for run %s step %d expects policy version %d, the engine has %d", body.run, body.step,
                    body.policy_version, live.engine.policy_version)
    payload = body.model_dump(mode="json")
    fingerprint = store.request_fingerprint(payload)
    async with state.submit_lock:
        if body.idempotency_key is not None:
            row = await run_in_threadpool(_by_key, state, body.idempotency_key)
            if row is not None:
                if row.request_hash != fingerprint:
                    raise HTTPException(status.HTTP_409_CONFLICT,
                                        detail=f"idempotency_key {body.idempotency_key!r} was used for another request")
                return await _resume(state, live, row, body)
        todo = _all_pairs(body)
        _reserve(state, live, len(todo))
        batch_id = uuid.uuid4().hex
        await run_in_threadpool(_create, state, batch_id, body, fingerprint, payload)
        live.runner.start(batch_id=batch_id, request=body, todo=todo)
    return BatchCreated(batch_id=batch_id, status="running")


def _by_key(state: GatewayState, key: str) -> store.BatchRow | None:
    with state.sessions() as session:
        return store.get_batch_by_key(session=session, idempotency_key=key)


def _create(state: GatewayState, batch_id: str, body: RolloutCreate, fingerprint: str, payload: dict[str, object]) -> None:
    with state.sessions() as session:
        store.create_batch(session=session, batch_id=batch_id, run=body.run, step=body.step,
                           idempotency_key=body.idempotency_key, request_hash=fingerprint,
                           request_json=json.dumps(payload), total=len(body.items) * body.samples_per_item)


@router.get("", response_model=RolloutPage, summary="List stored trajectories")
def list_rollouts(
    session: SessionDep,
    run: Annotated[str | None, Query(max_length=256)] = None,
    step_min: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    data_source: Annotated[str | None, Query(max_length=64)] = None,
    reward_min: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    reward_max: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    finish_reason: FinishReason | None = None,
    searched: Annotated[bool | None, Query(description="true: at least one search; false: none")] = None,
    cursor: Annotated[str | None, Query(pattern=r"^[0-9]{1,18}$", description="next_cursor of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> RolloutPage:
    rows, next_seq = store.list_trajectories(
        session=session, run=run, step_min=step_min, step_max=step_max, data_source=data_source,
        reward_min=reward_min, reward_max=reward_max, finish_reason=finish_reason, searched=searched,
        after_seq=int(cursor) if cursor else 0, limit=limit,
    )
    data = [store.to_summary(row) for row in rows]
    return RolloutPage(data=data, count=len(data), next_cursor=None if next_seq is None else str(next_seq))


def _trajectory_or_404(session: Session, trajectory_id: str) -> store.TrajectoryRow:
    row = store.get_trajectory(session=session, trajectory_id=trajectory_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"trajectory {trajectory_id!r} not found")
    return row


@router.get("/{trajectory_id}", response_model=TrajectoryDetail,
            summary="One trajectory with its token arrays and its newest SIS record")
def get_rollout(trajectory_id: str, session: SessionDep) -> TrajectoryDetail:
    trajectory = store.to_trajectory(_trajectory_or_404(session, trajectory_id))
    record = sis_store.newest_record(session=session, trajectory_id=trajectory_id)
    sis = sis_store.to_public(record) if record is not None else None
    return TrajectoryDetail(**dict(trajectory), sis=sis)


@router.get("/{trajectory_id}/texts", response_model=TrajectoryTexts,
            summary="The prompt and each response and top-K token decoded (for the viewer)")
def get_texts(trajectory_id: str, state: StateDep, session: SessionDep) -> TrajectoryTexts:
    trajectory = store.to_trajectory(_trajectory_or_404(session, trajectory_id))
    if state.texts is None:
        return TrajectoryTexts(tokenizer=None, prompt=None, pieces={})
    ids = sorted({*trajectory.response_ids, *(i for row in trajectory.topk_ids for i in row)})
    pieces = dict(zip((str(i) for i in ids), state.texts.pieces(ids), strict=True))
    return TrajectoryTexts(tokenizer=state.texts.name, prompt=state.texts.text(trajectory.prompt_ids), pieces=pieces)
