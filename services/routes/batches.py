"""`/v1/batches`: status, progress and trajectories of a submitted batch; NDJSON stream while it runs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, HTTPException, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sisrl.services import store
from sisrl.services.deps import SessionDep, StateDep
from sisrl.services.schemas import BatchPublic, Progress, RolloutCreate
from sisrl.services.state import GatewayState

router = APIRouter(prefix="/v1/batches", tags=["batches"])


def _row_or_404(state: GatewayState, batch_id: str) -> store.BatchRow:
    with state.sessions() as session:
        row = store.get_batch(session=session, batch_id=batch_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"batch {batch_id!r} not found")
    return row


@router.get("/{batch_id}", response_model=BatchPublic, summary="Batch status, progress and trajectories")
def get_batch(batch_id: str, state: StateDep, session: SessionDep) -> BatchPublic:
    row = _row_or_404(state, batch_id)
    request = RolloutCreate.model_validate_json(row.request_json)
    done = store.done_samples(session=session, batch_id=batch_id)
    have: dict[str, int] = {}
    for item_id, _ in done:
        have[item_id] = have.get(item_id, 0) + 1
    missing = [item.id for item in request.items if have.get(item.id, 0) < request.samples_per_item]
    running = state.is_running(batch_id)
    batch_status = "running" if running else row.status
    trajectories = None
    if batch_status in ("done", "failed"):
        trajectories = [store.to_trajectory(r) for _, r in store.batch_trajectories(session=session, batch_id=batch_id)]
    return BatchPublic(
        batch_id=batch_id, run=row.run, step=row.step, status=batch_status,  # type: ignore[arg-type]
        progress=Progress(done=len(done), total=row.total), missing_items=missing, trajectories=trajectories,
    )


@router.get(
    "/{batch_id}/stream",
    response_model=None,
    response_class=StreamingResponse,
    summary="Trajectories as NDJSON, one line each as they finish",
    responses={200: {"content": {"application/x-ndjson": {"schema": {"type": "string"}}},
                     "description": "one Trajectory JSON object per line; ends when the batch stops running"}},
)
async def stream_batch(batch_id: str, state: StateDep) -> StreamingResponse:
    await run_in_threadpool(_row_or_404, state, batch_id)
    return StreamingResponse(_lines(state, batch_id), media_type="application/x-ndjson")


async def _lines(state: GatewayState, batch_id: str) -> AsyncIterator[bytes]:
    last = 0
    while True:
        running = state.is_running(batch_id)  # read before the query: no row can slip past the end
        rows = await run_in_threadpool(_after, state, batch_id, last)
        for seq, line in rows:
            last = seq
            yield line
        if not running:
            return
        if not rows and state.live is not None:
            await state.live.runner.wait_change(batch_id, timeout=1.0)


def _after(state: GatewayState, batch_id: str, last: int) -> list[tuple[int, bytes]]:
    with state.sessions() as session:
        return [(seq, store.to_trajectory(row).model_dump_json().encode() + b"\n")
                for seq, row in store.batch_trajectories(session=session, batch_id=batch_id, after_seq=last)]
