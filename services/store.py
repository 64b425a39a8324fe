"""The rollout store: SQLAlchemy over SQLite (WAL) by default, PostgreSQL (psycopg 3) by URL.

Token arrays are stored as little-endian numpy bytes (int32 ids, uint8 mask, float32 log-probs, top-K as a
flattened [time, K] block plus K), never as JSON lists; so are the trainer's SIS records (`sis_records`, one row
per trajectory and policy version; their functions are in `sis_store`). Trajectories are indexed by run, step, data source,
reward and finish reason; `seq` (insertion order) is the pagination cursor. Functions are keyword-only.

Several gateway processes may share one PostgreSQL store: the database's unique keys decide every race (one
batch per idempotency key, one trajectory per (batch, item, sample)), and `claims` says which process runs a
batch. Schema creation runs under a transaction-level advisory lock, so replicas can start together.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
from sisrl.services.schemas import RewardParts, RunSummary, StepStats, Trajectory, TrajectorySummary, Turn
from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    func,
    select,
    text,
    update,
)
from sqlalchemy.engine import Engine, Row, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, load_only, mapped_column, sessionmaker


class Base(DeclarativeBase):
    pass


def _now() -> datetime:
    return datetime.now(timezone.utc)


class BatchRow(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run: Mapped[str] = mapped_column(String(256), index=True)
    step: Mapped[int] = mapped_column(Integer)
    idempotency_key: Mapped[str | None] = mapped_column(String(256), unique=True, nullable=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    request_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    total: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class TrajectoryRow(Base):
    __tablename__ = "trajectories"
    __table_args__ = (
        UniqueConstraint("batch_id", "item_id", "sample_index", name="uq_trajectory_sample"),
        Index("ix_traj_run_step", "run", "step"),
    )

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), index=True)
    item_id: Mapped[str] = mapped_column(String(256))
    sample_index: Mapped[int] = mapped_column(Integer)
    group_id: Mapped[str] = mapped_column(String(64))
    run: Mapped[str] = mapped_column(String(256))
    step: Mapped[int] = mapped_column(Integer)
    data_source: Mapped[str] = mapped_column(String(64), index=True)
    question: Mapped[str] = mapped_column(Text)
    golden_answers: Mapped[list[str]] = mapped_column(JSON)
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)
    response_ids: Mapped[bytes] = mapped_column(LargeBinary)
    loss_mask: Mapped[bytes] = mapped_column(LargeBinary)
    behaviour_logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    topk_k: Mapped[int] = mapped_column(Integer)
    topk_ids: Mapped[bytes] = mapped_column(LargeBinary)
    topk_logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    turns: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    num_searches: Mapped[int] = mapped_column(Integer)
    response_len: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(16), index=True)
    answer: Mapped[str | None] = mapped_column(Text, nullable=True)
    reward: Mapped[float] = mapped_column(Float, index=True)
    em: Mapped[float] = mapped_column(Float)
    f1: Mapped[float] = mapped_column(Float)
    format: Mapped[float] = mapped_column(Float)
    policy_version: Mapped[int] = mapped_column(Integer)
    # int32 version per response token (-1 at inserted ones) and the newest of them; NULL in rows stored before
    # these columns existed: every policy token is then `policy_version`'s.
    token_versions: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    policy_version_max: Mapped[int | None] = mapped_column(Integer, nullable=True)
    timings: Mapped[dict[str, float]] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class SisRecordRow(Base):
    """The trainer's SIS decisions for one trajectory under one policy version (int8 status, float32 arrays),
    with their counts and D / D_SIS precomputed so per-step statistics are SQL aggregates."""

    __tablename__ = "sis_records"
    __table_args__ = (
        UniqueConstraint("trajectory_id", "policy_version", name="uq_sis_record"),
        Index("ix_sis_run_step", "run", "step"),
    )

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    trajectory_id: Mapped[str] = mapped_column(ForeignKey("trajectories.id"), index=True)
    run: Mapped[str] = mapped_column(String(256))
    step: Mapped[int] = mapped_column(Integer)
    policy_version: Mapped[int] = mapped_column(Integer)
    advantage: Mapped[float] = mapped_column(Float)
    status: Mapped[bytes] = mapped_column(LargeBinary)
    ratio: Mapped[bytes] = mapped_column(LargeBinary)
    logp: Mapped[bytes] = mapped_column(LargeBinary)
    log_m: Mapped[bytes] = mapped_column(LargeBinary)
    accepted: Mapped[int] = mapped_column(Integer)
    rejected: Mapped[int] = mapped_column(Integer)
    outside: Mapped[int] = mapped_column(Integer)
    d: Mapped[float] = mapped_column(Float)
    d_sis: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now, onupdate=_now)


def display_url(url: str) -> str:
    """`url` fit for a log line: its password as `***` (`postgresql://user:***@host/db`). A URL SQLAlchemy cannot
    parse is not shown at all, since where its password sits is unknown."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(a database URL SQLAlchemy cannot parse; not shown)"


def open_db(url: str) -> sessionmaker[Session]:
    """Create the tables if needed and return a session factory; SQLite gets WAL and a busy timeout."""
    is_sqlite = url.startswith("sqlite")
    connect_args = {"check_same_thread": False, "timeout": 30} if is_sqlite else {}
    engine = create_engine(url, connect_args=connect_args, pool_pre_ping=not is_sqlite)
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # Replicas starting together would race on CREATE TABLE; PostgreSQL's DDL is transactional, so the
                # lock (released at commit) makes the second one find the tables made by the first.
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK})
            Base.metadata.create_all(conn)
            _add_new_columns(conn)
    except OperationalError as exc:  # no server, refused login, unwritable file: name the store, not the stack
        engine.dispose()
        reason = " ".join(str(exc.orig if exc.orig is not None else exc).split())
        raise StoreUnavailable(f"cannot open the rollout store {engine.url.render_as_string(hide_password=True)}: "
                               f"{reason}") from exc
    return sessionmaker(engine, expire_on_commit=False)


def _add_new_columns(conn: Any) -> None:
    """A store written by an older release lacks the nullable columns added since; add them (ALTER TABLE ... ADD
    COLUMN, the same on SQLite and PostgreSQL). Rows stored before read NULL there, which readers handle."""
    from sqlalchemy import inspect

    inspector = inspect(conn)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have and column.nullable:
                kind = column.type.compile(dialect=conn.dialect)
                conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))


class StoreUnavailable(RuntimeError):
    """`open_db` could not reach or create the store; the message names it (password hidden) and the reason."""


_SCHEMA_LOCK = int.from_bytes(hashlib.sha256(b"sisrl-schema").digest()[:8], "big") >> 1


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets readers (the REST API) run while the batch runner writes; synchronous=NORMAL is durable in WAL.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def dispose(factory: sessionmaker[Session]) -> None:
    bind = factory.kw["bind"]
    if isinstance(bind, Engine):
        bind.dispose()


# ---- batches ---------------------------------------------------------------------------------------------------
def create_batch(
    *, session: Session, batch_id: str, run: str, step: int, idempotency_key: str | None,
    request_hash: str, request_json: str, total: int,
) -> BatchRow:
    """Store a new `running` batch and return it; when another process stored the same idempotency key first,
    return that batch instead (the unique key decides the race; compare the returned id with `batch_id`)."""
    row = BatchRow(
        id=batch_id, run=run, step=step, idempotency_key=idempotency_key, request_hash=request_hash,
        request_json=request_json, status="running", total=total,
    )
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        existing = get_batch_by_key(session=session, idempotency_key=idempotency_key) if idempotency_key else None
        if existing is None:
            raise
        return existing
    return row


def get_batch(*, session: Session, batch_id: str) -> BatchRow | None:
    return session.get(BatchRow, batch_id)


def batch_status(*, session: Session, batch_id: str) -> str | None:
    """The stored status as committed now (never a cached row)."""
    return session.scalar(select(BatchRow.status).where(BatchRow.id == batch_id))


def get_batch_by_key(*, session: Session, idempotency_key: str) -> BatchRow | None:
    return session.scalars(select(BatchRow).where(BatchRow.idempotency_key == idempotency_key)).first()


def set_batch_status(*, session: Session, batch_id: str, status: str) -> None:
    session.execute(update(BatchRow).where(BatchRow.id == batch_id).values(status=status))
    session.commit()


def mark_interrupted(*, session: Session, batch_ids: Collection[str] | None = None) -> int:
    """Batches left `running` become `partial` (those of `batch_ids`, or every one when None); returns how many."""
    query = update(BatchRow).where(BatchRow.status == "running")
    if batch_ids is not None:
        query = query.where(BatchRow.id.in_(list(batch_ids)))
    result = session.execute(query.values(status="partial"))
    session.commit()
    return int(getattr(result, "rowcount", 0) or 0)


def done_samples(*, session: Session, batch_id: str) -> set[tuple[str, int]]:
    rows = session.execute(
        select(TrajectoryRow.item_id, TrajectoryRow.sample_index).where(TrajectoryRow.batch_id == batch_id)
    )
    return {(item_id, idx) for item_id, idx in rows}


def count_errors(*, session: Session, batch_id: str) -> tuple[int, int]:
    """(trajectories, trajectories with an error) of a batch."""
    row = session.execute(
        select(func.count(), func.count(TrajectoryRow.error)).where(TrajectoryRow.batch_id == batch_id)
    ).one()
    return int(row[0]), int(row[1])


def first_error(*, session: Session, batch_id: str) -> str | None:
    """The error of the batch's first stored trajectory that ended with one (insertion order), or None."""
    query = (select(TrajectoryRow.error).where(TrajectoryRow.batch_id == batch_id, TrajectoryRow.error.is_not(None))
             .order_by(TrajectoryRow.seq).limit(1))
    return session.scalars(query).first()


# ---- trajectories ----------------------------------------------------------------------------------------------
def add_trajectory(*, session: Session, trajectory: Trajectory, sample_index: int) -> bool:
    """Insert one trajectory; False (and nothing written) when that (batch, item, sample) is already stored,
    also when another process stored it between our check and our insert (the unique key refuses it)."""
    t = trajectory
    if _has_sample(session, t.batch_id, t.item_id, sample_index):
        return False
    k = len(t.topk_ids[0]) if t.topk_ids else 0
    versions = t.token_versions if t.token_versions is not None else _uniform_versions(t.loss_mask, t.policy_version)
    if len(versions) != len(t.response_ids):
        raise ValueError(f"trajectory {t.id}: {len(versions)} token_versions for {len(t.response_ids)} tokens")
    session.add(TrajectoryRow(
        id=t.id, batch_id=t.batch_id, item_id=t.item_id, sample_index=sample_index, group_id=t.group_id,
        run=t.run, step=t.step, data_source=t.data_source, question=t.question, golden_answers=t.golden_answers,
        prompt_ids=pack(t.prompt_ids, np.int32), response_ids=pack(t.response_ids, np.int32),
        loss_mask=pack(t.loss_mask, np.uint8), behaviour_logprobs=pack(t.behaviour_logprobs, np.float32),
        topk_k=k, topk_ids=pack(t.topk_ids, np.int32), topk_logprobs=pack(t.topk_logprobs, np.float32),
        turns=[turn.model_dump() for turn in t.turns], num_searches=len(t.turns), response_len=len(t.response_ids),
        finish_reason=t.finish_reason, answer=t.answer, reward=t.reward, em=t.reward_parts.em,
        f1=t.reward_parts.f1, format=t.reward_parts.format, policy_version=t.policy_version,
        token_versions=pack(versions, np.int32), policy_version_max=max([t.policy_version, *versions]),
        timings=t.timings, error=t.error,
    ))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        if _has_sample(session, t.batch_id, t.item_id, sample_index):
            return False
        raise
    return True


def _has_sample(session: Session, batch_id: str, item_id: str, sample_index: int) -> bool:
    col = TrajectoryRow
    query = select(col.seq).where(col.batch_id == batch_id, col.item_id == item_id, col.sample_index == sample_index)
    return session.scalar(query) is not None


def pack(values: Sequence[Any] | np.ndarray, dtype: type[np.generic]) -> bytes:
    return np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def unpack(raw: bytes, dtype: type[np.generic]) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))


def _uniform_versions(mask: Sequence[int], version: int) -> list[int]:
    return [version if m else -1 for m in mask]


def to_trajectory(row: TrajectoryRow) -> Trajectory:
    k = row.topk_k
    mask = unpack(row.loss_mask, np.uint8).tolist()
    versions = (unpack(row.token_versions, np.int32).tolist() if row.token_versions is not None
                else _uniform_versions(mask, row.policy_version))
    topk_ids = unpack(row.topk_ids, np.int32).reshape(-1, k) if k else np.zeros((0, 0), np.int32)
    topk_lp = unpack(row.topk_logprobs, np.float32).reshape(-1, k) if k else np.zeros((0, 0), np.float32)
    return Trajectory(
        id=row.id, batch_id=row.batch_id, item_id=row.item_id, group_id=row.group_id, run=row.run,
        step=row.step, data_source=row.data_source, question=row.question, golden_answers=row.golden_answers,
        prompt_ids=unpack(row.prompt_ids, np.int32).tolist(),
        response_ids=unpack(row.response_ids, np.int32).tolist(),
        loss_mask=mask, behaviour_logprobs=unpack(row.behaviour_logprobs, np.float32).tolist(),
        topk_ids=topk_ids.tolist(), topk_logprobs=topk_lp.tolist(), token_versions=versions,
        turns=[Turn(**turn) for turn in row.turns], finish_reason=row.finish_reason,  # type: ignore[arg-type]
        answer=row.answer, reward=row.reward, reward_parts=RewardParts(em=row.em, f1=row.f1, format=row.format),
        policy_version=row.policy_version, timings=row.timings, error=row.error,
    )


def to_summary(row: TrajectoryRow) -> TrajectorySummary:
    return TrajectorySummary(
        id=row.id, batch_id=row.batch_id, item_id=row.item_id, group_id=row.group_id, run=row.run,
        step=row.step, data_source=row.data_source, finish_reason=row.finish_reason,  # type: ignore[arg-type]
        answer=row.answer, reward=row.reward, reward_parts=RewardParts(em=row.em, f1=row.f1, format=row.format),
        num_searches=row.num_searches, response_len=row.response_len, policy_version=row.policy_version,
        policy_version_max=row.policy_version_max if row.policy_version_max is not None else row.policy_version,
        error=row.error,
    )


def batch_trajectories(*, session: Session, batch_id: str, after_seq: int = 0) -> list[tuple[int, TrajectoryRow]]:
    rows = session.scalars(
        select(TrajectoryRow).where(TrajectoryRow.batch_id == batch_id, TrajectoryRow.seq > after_seq)
        .order_by(TrajectoryRow.seq)
    )
    return [(row.seq, row) for row in rows]


# What a page of `GET /v1/batches/{id}/trajectories.arrow` reads (services/arrow_pages.py): the token blobs as
# stored, and none of the columns the trainer does not read (question, gold answers, timings).
PAGE_COLUMNS = (
    TrajectoryRow.id, TrajectoryRow.item_id, TrajectoryRow.group_id, TrajectoryRow.data_source,
    TrajectoryRow.prompt_ids, TrajectoryRow.response_ids, TrajectoryRow.loss_mask, TrajectoryRow.behaviour_logprobs,
    TrajectoryRow.topk_k, TrajectoryRow.topk_ids, TrajectoryRow.topk_logprobs, TrajectoryRow.token_versions,
    TrajectoryRow.policy_version, TrajectoryRow.reward, TrajectoryRow.em, TrajectoryRow.f1, TrajectoryRow.format,
    TrajectoryRow.turns, TrajectoryRow.finish_reason, TrajectoryRow.answer, TrajectoryRow.error,
)


def count_batch(*, session: Session, batch_id: str) -> int:
    """Trajectories stored for a batch."""
    return int(session.scalar(select(func.count()).where(TrajectoryRow.batch_id == batch_id)) or 0)


def batch_page(*, session: Session, batch_id: str, offset: int, limit: int) -> Sequence[Row[Any]]:
    """Trajectories `offset` .. `offset + limit - 1` of a batch in insertion order, `PAGE_COLUMNS` only."""
    query = (select(*PAGE_COLUMNS).where(TrajectoryRow.batch_id == batch_id).order_by(TrajectoryRow.seq)
             .offset(offset).limit(limit))
    return session.execute(query).all()


def get_trajectory(*, session: Session, trajectory_id: str) -> TrajectoryRow | None:
    return session.scalars(select(TrajectoryRow).where(TrajectoryRow.id == trajectory_id)).first()


def list_trajectories(
    *, session: Session, run: str | None = None, step_min: int | None = None, step_max: int | None = None,
    data_source: str | None = None, reward_min: float | None = None, reward_max: float | None = None,
    finish_reason: str | None = None, searched: bool | None = None, after_seq: int = 0, limit: int = 100,
) -> tuple[list[TrajectoryRow], int | None]:
    """One page of trajectories in insertion order, and the cursor of the next page (None on the last). Only the
    columns of a summary (`to_summary`) are read: the token blobs, most of a row's bytes, stay in the store
    (reading one of them from a returned row loads it then, row by row)."""
    query = select(TrajectoryRow).options(load_only(*_SUMMARY_COLUMNS)).where(TrajectoryRow.seq > after_seq)
    col = TrajectoryRow
    if run is not None:
        query = query.where(col.run == run)
    if step_min is not None:
        query = query.where(col.step >= step_min)
    if step_max is not None:
        query = query.where(col.step <= step_max)
    if data_source is not None:
        query = query.where(col.data_source == data_source)
    if reward_min is not None:
        query = query.where(col.reward >= reward_min)
    if reward_max is not None:
        query = query.where(col.reward <= reward_max)
    if finish_reason is not None:
        query = query.where(col.finish_reason == finish_reason)
    if searched is not None:
        query = query.where(col.num_searches > 0 if searched else col.num_searches == 0)
    rows = list(session.scalars(query.order_by(TrajectoryRow.seq).limit(limit + 1)))
    if len(rows) > limit:
        return rows[:limit], rows[limit - 1].seq
    return rows, None


_SUMMARY_COLUMNS = (
    TrajectoryRow.seq, TrajectoryRow.id, TrajectoryRow.batch_id, TrajectoryRow.item_id, TrajectoryRow.group_id,
    TrajectoryRow.run, TrajectoryRow.step, TrajectoryRow.data_source, TrajectoryRow.finish_reason,
    TrajectoryRow.answer, TrajectoryRow.reward, TrajectoryRow.em, TrajectoryRow.f1, TrajectoryRow.format,
    TrajectoryRow.num_searches, TrajectoryRow.response_len, TrajectoryRow.policy_version,
    TrajectoryRow.policy_version_max, TrajectoryRow.error,
)


def run_stats(*, session: Session, run: str) -> list[StepStats]:
    """Per step: trajectories, mean reward, EM per data source, searches, response length, finish reasons."""
    cols = (TrajectoryRow.step, TrajectoryRow.data_source, TrajectoryRow.finish_reason)
    rows = session.execute(
        select(*cols, func.count(), func.sum(TrajectoryRow.reward), func.sum(TrajectoryRow.em),
               func.sum(TrajectoryRow.num_searches), func.sum(TrajectoryRow.response_len))
        .where(TrajectoryRow.run == run).group_by(*cols).order_by(TrajectoryRow.step)
    ).all()
    acc: dict[int, dict[str, Any]] = {}
    for step, source, finish, n, reward, em, searches, length in rows:
        s = acc.setdefault(step, {"n": 0, "reward": 0.0, "searches": 0, "len": 0, "em": {}, "finish": {}})
        s["n"] += n
        s["reward"] += reward
        s["searches"] += searches
        s["len"] += length
        em_n, em_sum = s["em"].get(source, (0, 0.0))
        s["em"][source] = (em_n + n, em_sum + em)
        s["finish"][finish] = s["finish"].get(finish, 0) + n
    return [
        StepStats(
            step=step, trajectories=s["n"], reward_mean=s["reward"] / s["n"],
            em_by_source={src: total / count for src, (count, total) in sorted(s["em"].items())},
            searches_mean=s["searches"] / s["n"], response_len_mean=s["len"] / s["n"], finish_reasons=s["finish"],
        )
        for step, s in sorted(acc.items())
    ]


def list_runs(*, session: Session, limit: int = 1000) -> list[RunSummary]:
    """Runs with stored trajectories, the most recently started first, with their SIS record counts."""
    col = TrajectoryRow
    rows = session.execute(
        select(col.run, func.count(), func.count(func.distinct(col.step)), func.min(col.step), func.max(col.step))
        .group_by(col.run).order_by(func.min(col.seq).desc()).limit(limit)
    ).all()
    sis = dict(session.execute(  # type: ignore[arg-type]
        select(SisRecordRow.run, func.count()).where(SisRecordRow.run.in_([r[0] for r in rows]))
        .group_by(SisRecordRow.run)
    ).all())
    return [RunSummary(run=run, trajectories=n, steps=steps, first_step=lo, last_step=hi, sis_records=sis.get(run, 0))
            for run, n, steps, lo, hi in rows]


def request_fingerprint(body: dict[str, Any]) -> str:
    """A stable hash of a rollout request without its idempotency key (to detect a reused key)."""
    payload = {k: v for k, v in body.items() if k != "idempotency_key"}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
