"""`/v1/sis_records`: the trainer posts its per-token SIS decisions for the trajectories it trained on."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status
from sisrl.common.wire import MAX_SIS_RECORDS
from sisrl.services import sis_store
from sisrl.services.deps import SessionDep
from sisrl.services.schemas import SisRecordsCreate, SisStored

router = APIRouter(prefix="/v1/sis_records", tags=["sis"])


@router.post("", response_model=SisStored, summary="Store SIS records (one per trajectory and policy version)",
             responses={413: {"description": f"more than {MAX_SIS_RECORDS} records, or a body over the size limit"},
                        404: {"description": "a record names a trajectory the store does not hold"},
                        400: {"description": "a record that breaks a rule the schema cannot state: arrays of "
                                             "different lengths, two records for one (trajectory, version), or one "
                                             "that does not fit its trajectory (run, length, a decision on an "
                                             "inserted token); nothing is stored then"}})
def post_sis_records(body: SisRecordsCreate, session: SessionDep) -> SisStored:
    """Each record holds, per response token, the status (1 accepted, 0 rejected, 2 outside V_K, -1 not a policy
    token), the ratio used, log pi and log M_t, plus the advantage and the policy version. A record for a
    (trajectory, policy version) already stored replaces it. All records are checked before any is written."""
    if len(body.records) > MAX_SIS_RECORDS:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                            detail=f"{len(body.records)} records in one request, the limit is {MAX_SIS_RECORDS}: "
                                   "split the list (GatewayClient.post_sis_records does)")
    rule = body.rule_error()
    if rule is not None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, detail=_detail(rule[0], rule[1]))
    try:
        stored, replaced = sis_store.put_records(session=session, run=body.run, step=body.step, records=body.records)
    except sis_store.UnknownTrajectory as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=str(exc)) from exc
    except sis_store.RecordMismatch as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, detail=_detail(exc.index, str(exc))) from exc
    return SisStored(run=body.run, step=body.step, stored=stored, replaced=replaced)


def _detail(index: int, why: str) -> list[dict[str, object]]:
    """Shaped like FastAPI's validation detail, with the record's index in `loc`."""
    return [{"loc": ["body", "records", index], "msg": why, "type": "value_error"}]
