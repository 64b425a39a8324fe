"""`/v1/batches`: status, progress and trajectories of a submitted batch; NDJSON stream while it runs; pages of a
finished batch as Arrow IPC streams (the trainer's binary form, docs/gateway.md "Arrow").

Every gateway on the same store answers alike: a batch is `running` while some process (this one or another
gateway on the same PostgreSQL) holds its claim (`claims`), and `partial` once its owner is gone.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sisrl.common import arrow_wire
from sisrl.services import arrow_pages, claims, store
from sisrl.services.deps import SessionDep, StateDep
from sisrl.services.schemas import BatchPublic, Progress, RolloutCreate
from sisrl.services.state import GatewayState
from sqlalchemy.orm import Session

router = APIRouter(prefix="/v1/batches", tags=["batches"])


def _row_or_404(state: GatewayState, batch_id: str) -> store.BatchRow:
    with state.sessions() as session:
        row = store.get_batch(session=session, batch_id=batch_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"batch {batch_id!r} not found")
    return row


@router.get("/{batch_id}", response_model=BatchPublic, summary="Batch status, progress and trajectories")
def get_batch(
    batch_id: str, state: StateDep, session: SessionDep,
    trajectories: Annotated[bool, Query(description="false: status and progress only (a client that reads the "
                                                    "trajectories as Arrow pages polls this way)")] = True,
) -> BatchPublic:
    row = _row_or_404(state, batch_id)
    request = RolloutCreate.model_validate_json(row.request_json)
    done = store.done_samples(session=session, batch_id=batch_id)
    have: dict[str, int] = {}
    for item_id, _ in done:
        have[item_id] = have.get(item_id, 0) + 1
    missing = [item.id for item in request.items if have.get(item.id, 0) < request.samples_per_item]
    batch_status = _status(state, session, row)
    trajs = None
    if trajectories and batch_status in ("done", "failed"):
        trajs = [store.to_trajectory(r) for _, r in store.batch_trajectories(session=session, batch_id=batch_id)]
    return BatchPublic(
        batch_id=batch_id, run=row.run, step=row.step, status=batch_status,  # type: ignore[arg-type]
        progress=Progress(done=len(done), total=row.total), missing_items=missing, trajectories=trajs,
        error=store.first_error(session=session, batch_id=batch_id),
    )


@router.get(
    "/{batch_id}/trajectories.arrow",
    response_model=None,
    response_class=Response,
    summary="One page of a finished batch's trajectories as an Arrow IPC stream",
    responses={
        200: {"content": {arrow_wire.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
              "description": "an Arrow IPC stream (schema with the page's metadata, one record batch, end marker); "
                             f"headers {arrow_wire.HEADER_TOTAL}, {arrow_wire.HEADER_ROWS}, "
                             f"{arrow_wire.HEADER_SHA256} and, unless it is the last page, "
                             f"{arrow_wire.HEADER_NEXT}"},
        404: {"description": "no such batch"},
        409: {"description": "the batch is still running: its trajectories are not final"},
    },
)
def get_trajectories_arrow(
    batch_id: str, state: StateDep, session: SessionDep,
    offset: Annotated[int, Query(ge=0, le=10**9, description="first trajectory of the page (insertion order)")] = 0,
    limit: Annotated[int, Query(ge=1, le=1024, description="trajectories in the page at most")] = 64,
) -> Response:
    row = _row_or_404(state, batch_id)
    if _status(state, session, row) == "running":
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"batch {batch_id!r} is still running; "
                            "its trajectories are served as Arrow once it stops")
    total = store.count_batch(session=session, batch_id=batch_id)
    rows = store.batch_page(session=session, batch_id=batch_id, offset=offset, limit=limit)
    body = arrow_wire.to_stream(arrow_pages.page_batch(rows, batch_id=batch_id, offset=offset, total=total))
    headers = {arrow_wire.HEADER_TOTAL: str(total), arrow_wire.HEADER_ROWS: str(len(rows)),
               arrow_wire.HEADER_SHA256: hashlib.sha256(body).hexdigest()}
    if offset + len(rows) < total:
        headers[arrow_wire.HEADER_NEXT] = str(offset + len(rows))
    return Response(content=body, media_type=arrow_wire.MEDIA_TYPE, headers=headers)


def _status(state: GatewayState, session: Session, row: store.BatchRow) -> str:
    """The batch's status as every gateway on the store sees it."""
    if state.is_running(row.id):
        return "running"
    if row.status != "running":
        return row.status
    owners = claims.owned(session, [row.id])
    if owners is None or row.id in owners:  # SQLite: the stored status is the truth
        return "running"
    # Nobody holds it now. Read again: its owner stores the final status before letting go, so a batch that
    # finished since `row` was read shows that status; one still `running` lost its owner (a killed gateway).
    now = store.batch_status(session=session, batch_id=row.id)
    return "partial" if now in (None, "running") else now


def _running_anywhere(state: GatewayState, batch_id: str) -> bool:
    with state.sessions() as session:
        row = store.get_batch(session=session, batch_id=batch_id)
        return row is not None and _status(state, session, row) == "running"


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
        # Read before the query, so no row can slip past the end.
        here = state.is_running(batch_id)
        running = here or await run_in_threadpool(_running_anywhere, state, batch_id)
        rows = await run_in_threadpool(_after, state, batch_id, last)
        for seq, line in rows:
            last = seq
            yield line
        if not running:
            return
        if rows:
            continue
        if here and state.live is not None:
            await state.live.runner.wait_change(batch_id, timeout=1.0)
        else:  # another gateway runs it: no event reaches this process, so poll the store
            await asyncio.sleep(0.5)


def _after(state: GatewayState, batch_id: str, last: int) -> list[tuple[int, bytes]]:
    with state.sessions() as session:
        return [(seq, store.to_trajectory(row).model_dump_json().encode() + b"\n")
                for seq, row in store.batch_trajectories(session=session, batch_id=batch_id, after_seq=last)]
