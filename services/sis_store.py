"""The trainer's SIS records in the rollout store (table `sis_records`, defined in `store`): checked writes,
reads, per-step statistics and per-token counts. One SQLAlchemy code path for SQLite and Postgres.

Each record is checked against its trajectory before anything is written: the same run, one entry per response
token, and no decision (status 0, 1, 2) on a token the environment inserted (loss mask 0; docs/design.md,
"Masking": those count nowhere). D and D_SIS are computed here with l_t = logp_t - behaviour_logprobs_t, i.e.
against the behaviour log-probs the engine recorded (the `rollout` source of q). Functions are keyword-only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from sisrl.common.wire import SIS_ACCEPTED, SIS_OUTSIDE, SIS_REJECTED
from sisrl.services.schemas import (
    SisRecordIn,
    SisRecordPublic,
    SisStepStats,
    SisSummary,
    SisTokens,
    TokenCount,
)
from sisrl.services.store import SisRecordRow, TrajectoryRow, pack, unpack
from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session


class UnknownTrajectory(LookupError):
    """A record names a trajectory the store does not hold."""


class RecordMismatch(ValueError):
    """Record number `index` of a request does not fit its trajectory (the message says how)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class _Target:
    """What a record is checked against: its trajectory's run, loss mask and log q, each [response_len]."""

    run: str
    mask: np.ndarray
    logq: np.ndarray


def put_records(*, session: Session, run: str, step: int, records: list[SisRecordIn]) -> tuple[int, int]:
    """Check every record, then write all of them in one transaction; a record whose (trajectory, policy version)
    is stored already replaces it. Returns (stored, replaced). Raises UnknownTrajectory or RecordMismatch (naming
    the trajectory and what is wrong) before writing anything."""
    ids = sorted({r.trajectory_id for r in records})
    targets = _targets(session, ids)
    missing = [i for i in ids if i not in targets]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UnknownTrajectory(f"trajectory {missing[0]!r} not found{more}")
    values = []
    for index, record in enumerate(records):
        try:
            values.append(_values(run, step, record, targets[record.trajectory_id]))
        except ValueError as exc:
            raise RecordMismatch(index, str(exc)) from exc
    try:
        return _write(session, ids, values)
    except IntegrityError:
        # A concurrent request inserted one of these (trajectory, version) pairs after our read: it is there now.
        session.rollback()
        return _write(session, ids, values)


def _targets(session: Session, ids: list[str]) -> dict[str, _Target]:
    col = TrajectoryRow
    rows = session.execute(select(col.id, col.run, col.loss_mask, col.behaviour_logprobs).where(col.id.in_(ids)))
    return {tid: _Target(run=run, mask=unpack(mask, np.uint8), logq=unpack(logq, np.float32).astype(np.float64))
            for tid, run, mask, logq in rows}


def _values(run: str, step: int, record: SisRecordIn, target: _Target) -> dict[str, Any]:
    tid = record.trajectory_id
    if target.run != run:
        raise ValueError(f"trajectory {tid!r} belongs to run {target.run!r}, not {run!r}")
    n, expected = len(record.status), len(target.mask)
    if n != expected:
        raise ValueError(f"trajectory {tid!r}: the record has {n} entries per array, the trajectory has "
                         f"{expected} response tokens")
    status = np.asarray(record.status, dtype=np.int8)
    decided = status >= 0
    wrong = np.flatnonzero(decided & (target.mask == 0))
    if wrong.size:
        t = int(wrong[0])
        raise ValueError(f"trajectory {tid!r}: response token {t} was inserted by the environment (loss mask 0) "
                         f"but has status {int(status[t])}; expected -1")
    logp = np.asarray(record.logp, dtype=np.float32)
    abs_l = np.abs(logp.astype(np.float64) - target.logq)  # |l_t| = |log pi - log q|, [response_len]
    rejected = (status == SIS_REJECTED) | (status == SIS_OUTSIDE)
    return {
        "trajectory_id": tid, "run": run, "step": step, "policy_version": record.policy_version,
        "advantage": record.advantage, "status": pack(status, np.int8), "ratio": pack(record.ratio, np.float32),
        "logp": pack(logp, np.float32), "log_m": pack(record.log_m, np.float32),
        "accepted": int((status == SIS_ACCEPTED).sum()), "rejected": int((status == SIS_REJECTED).sum()),
        "outside": int((status == SIS_OUTSIDE).sum()), "d": float(abs_l[decided].sum()),
        "d_sis": float(abs_l[rejected].sum()),
    }


def _write(session: Session, ids: list[str], values: list[dict[str, Any]]) -> tuple[int, int]:
    col = SisRecordRow
    stored = {(tid, version): seq for seq, tid, version in
              session.execute(select(col.seq, col.trajectory_id, col.policy_version).where(col.trajectory_id.in_(ids)))}
    fresh = [v for v in values if (v["trajectory_id"], v["policy_version"]) not in stored]
    for v in values:
        seq = stored.get((v["trajectory_id"], v["policy_version"]))
        if seq is not None:
            session.execute(update(col).where(col.seq == seq).values(**v))
    if fresh:
        session.execute(insert(col), fresh)
    session.commit()
    return len(values), len(values) - len(fresh)


def newest_record(*, session: Session, trajectory_id: str) -> SisRecordRow | None:
    """The record of the highest policy version of a trajectory, or None."""
    col = SisRecordRow
    return session.scalars(select(col).where(col.trajectory_id == trajectory_id)
                           .order_by(col.policy_version.desc()).limit(1)).first()


def to_public(row: SisRecordRow) -> SisRecordPublic:
    return SisRecordPublic(
        run=row.run, step=row.step, policy_version=row.policy_version, advantage=row.advantage,
        status=unpack(row.status, np.int8).tolist(), ratio=unpack(row.ratio, np.float32).tolist(),
        logp=unpack(row.logp, np.float32).tolist(), log_m=unpack(row.log_m, np.float32).tolist(),
        summary=SisSummary(accepted=row.accepted, rejected=row.rejected, outside=row.outside, d=row.d, d_sis=row.d_sis),
    )


def step_stats(*, session: Session, run: str) -> list[SisStepStats]:
    """Per trainer step: records, decided tokens, accept rate, mean D and D_SIS per record."""
    col = SisRecordRow
    rows = session.execute(
        select(col.step, func.count(), func.sum(col.accepted), func.sum(col.rejected), func.sum(col.outside),
               func.sum(col.d), func.sum(col.d_sis))
        .where(col.run == run).group_by(col.step).order_by(col.step)
    ).all()
    out = []
    for step, n, acc, rej, outside, d, d_sis in rows:
        decided = int(acc) + int(rej) + int(outside)
        out.append(SisStepStats(step=step, records=n, policy_tokens=decided, accepted=acc, rejected=rej,
                                outside=outside, accept_rate=acc / decided if decided else 0.0, d_mean=d / n,
                                d_sis_mean=d_sis / n))
    return out


def token_counts(*, session: Session, run: str, step_min: int | None = None, step_max: int | None = None,
                 max_records: int = 2000, top: int = 30,
                 decode: Callable[[list[int]], list[str]] | None = None) -> SisTokens:
    """Per token id, how often it was accepted, rejected and outside V_K over the newest `max_records` records
    of a run (paper, Fig. 5); the `top` ids by accepted and by rejected + outside, decoded when `decode` is given."""
    col = SisRecordRow
    query = (select(col.status, TrajectoryRow.response_ids).join(TrajectoryRow, TrajectoryRow.id == col.trajectory_id)
             .where(col.run == run))
    if step_min is not None:
        query = query.where(col.step >= step_min)
    if step_max is not None:
        query = query.where(col.step <= step_max)
    rows = session.execute(query.order_by(col.seq.desc()).limit(max_records + 1)).all()
    truncated = len(rows) > max_records
    rows = rows[:max_records]
    empty = SisTokens(run=run, records_scanned=len(rows), truncated=truncated, most_accepted=[], most_rejected=[])
    if not rows:
        return empty
    status = np.concatenate([unpack(s, np.int8) for s, _ in rows])
    token_ids = np.concatenate([unpack(r, np.int32) for _, r in rows])
    uniq, inverse = np.unique(token_ids, return_inverse=True)  # no bincount over raw ids: they may be huge
    counts = {code: np.bincount(inverse[status == code], minlength=len(uniq))
              for code in (SIS_ACCEPTED, SIS_REJECTED, SIS_OUTSIDE)}

    def ranked(score: np.ndarray) -> list[int]:
        order = np.lexsort((uniq, -score))  # by score, high first; ties by token id
        return [int(i) for i in order[:top] if score[i] > 0]

    picks = {"most_accepted": ranked(counts[SIS_ACCEPTED]),
             "most_rejected": ranked(counts[SIS_REJECTED] + counts[SIS_OUTSIDE])}
    wanted = sorted({int(uniq[i]) for ids in picks.values() for i in ids})
    texts = dict(zip(wanted, decode(wanted), strict=True)) if decode else {}

    def entry(i: int) -> TokenCount:
        tid = int(uniq[i])
        return TokenCount(token_id=tid, text=texts.get(tid), accepted=int(counts[SIS_ACCEPTED][i]),
                          rejected=int(counts[SIS_REJECTED][i]), outside=int(counts[SIS_OUTSIDE][i]))

    return empty.model_copy(update={key: [entry(i) for i in ids] for key, ids in picks.items()})
