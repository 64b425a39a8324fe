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


async def _resume(state: GatewayState, live: Live, batch_id: str, body: RolloutCreate) -> BatchCreated:
    """Same idempotency key again (through this gateway or another on the same store): a finished batch, or
    one some process runs, is returned; an interrupted one is claimed here and runs its missing samples."""
    if live.runner.is_running(batch_id):
        return BatchCreated(batch_id=batch_id, status="running")
    claims = live.runner.claims
    if not await run_in_threadpool(claims.try_claim, batch_id):
        return BatchCreated(batch_id=batch_id, status="running")  # another gateway holds it: it is running there
    try:
        # Read after claiming: the previous owner stores the final status before it lets go of the claim.
        status_now, todo = await run_in_threadpool(_status_and_missing, state, batch_id, body)
        if status_now in ("done", "failed"):
            await run_in_threadpool(claims.release, batch_id)
            return BatchCreated(batch_id=batch_id, status=status_now)  # type: ignore[arg-type]
        _reserve(state, live, len(todo))
        await run_in_threadpool(_set_status, state, batch_id, "running")
    except BaseException:
        await run_in_threadpool(claims.release, batch_id)
        raise
    live.runner.start(batch_id=batch_id, request=body, todo=todo)
    return BatchCreated(batch_id=batch_id, status="running")


def _status_and_missing(state: GatewayState, batch_id: str, body: RolloutCreate) -> tuple[str, list[tuple[int, int]]]:
    with state.sessions() as session:
        status_now = store.batch_status(session=session, batch_id=batch_id)
        done = store.done_samples(session=session, batch_id=batch_id)
    assert status_now is not None, f"batch {batch_id} vanished from the store"
    return status_now, [(i, s) for i, s in _all_pairs(body) if (body.items[i].id, s) not in done]


def _set_status(state: GatewayState, batch_id: str, value: str) -> None:
    with state.sessions() as session:
        store.set_batch_status(session=session, batch_id=batch_id, status=value)


@router.post("", response_model=BatchCreated, summary="Submit a batch of rollouts",
             responses={400: {"description": "a body the schema accepts but that cannot run (item ids repeat), or "
                                             "one that cannot be parsed"},
                        409: {"description": "idempotency_key already used for another request, or a "
                                             "min_policy_version newer than the engine's"},
                        413: {"description": "more trajectories than max_pending in one batch"},
                        429: {"description": "the gateway has max_pending trajectories queued; retry after Retry-After"},
                        **STORE_ONLY_RESPONSE})
async def create_rollouts(body: RolloutCreate, state: StateDep, live: LiveDep) -> BatchCreated:
    """Start `samples_per_item` trajectories per item. A repeated `idempotency_key` never duplicates work, on
    this gateway or any other on the same store: it returns the same batch, and an interrupted batch runs only
    its missing samples."""
    why = body.rule_error()
    if why is not None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, detail=why)
    if body.policy_version != live.engine.policy_version:
        log.warning("batch for run %s step %d expects policy version %d, the engine has %d", body.run, body.step,
                    body.policy_version, live.engine.policy_version)
    payload = body.model_dump(mode="json")
    fingerprint = store.request_fingerprint(payload)
    async with state.submit_lock:
        if body.idempotency_key is not None:
            row = await run_in_threadpool(_by_key, state, body.idempotency_key)
            if row is not None:
                return await _resume(state, live, _same_request(row, body, fingerprint), body)
        served = live.engine.policy_version
        if body.min_policy_version is not None and body.min_policy_version > served:
            raise HTTPException(status.HTTP_409_CONFLICT,
                                detail=f"min_policy_version {body.min_policy_version}: the engine serves policy "
                                       f"version {served}; push that version first (POST /v1/policy)")
        todo = _all_pairs(body)
        _reserve(state, live, len(todo))
        batch_id = uuid.uuid4().hex
        claims = live.runner.claims
        # Claim the fresh id before its row exists, so no other gateway can think it is interrupted.
        claimed = await run_in_threadpool(claims.try_claim, batch_id)
        assert claimed, f"fresh batch id {batch_id} already claimed"
        try:
            stored = await run_in_threadpool(_create, state, batch_id, body, fingerprint, payload)
        except BaseException:
            await run_in_threadpool(claims.release, batch_id)
            raise
        if stored.id != batch_id:  # another gateway stored this idempotency key first: it is that batch
            await run_in_threadpool(claims.release, batch_id)
            return await _resume(state, live, _same_request(stored, body, fingerprint), body)
        live.runner.start(batch_id=batch_id, request=body, todo=todo)
    return BatchCreated(batch_id=batch_id, status="running")


def _same_request(row: store.BatchRow, body: RolloutCreate, fingerprint: str) -> str:
    """The id of the batch stored under this idempotency key; 409 when it was stored for another request."""
    if row.request_hash != fingerprint:
        raise HTTPException(status.HTTP_409_CONFLICT,
                            detail=f"idempotency_key {body.idempotency_key!r} was used for another request")
    return row.id


def _by_key(state: GatewayState, key: str) -> store.BatchRow | None:
    with state.sessions() as session:
        return store.get_batch_by_key(session=session, idempotency_key=key)


def _create(state: GatewayState, batch_id: str, body: RolloutCreate, fingerprint: str,
            payload: dict[str, object]) -> store.BatchRow:
    with state.sessions() as session:
        return store.create_batch(session=session, batch_id=batch_id, run=body.run, step=body.step,
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
