"""Who runs a batch: at most one gateway process at a time, among every gateway that shares the store.

PostgreSQL (several gateways on one database): the process that runs a batch holds a session-level advisory
lock keyed by the batch id (`pg_try_advisory_lock`, PostgreSQL manual "Advisory Lock Functions") on a
connection of its own. The server drops a session's locks when its connection ends, so a gateway that dies,
even by SIGKILL, frees its batches at once, with no lease to wait out: the next submission of the same
idempotency key, through any gateway, claims the batch and runs only its missing samples. Whether a batch
has an owner is read from `pg_locks` without taking the lock, so reading a status never blocks a claim.

SQLite (one generating gateway per file; store-only gateways may read beside it): claims are kept in process
and the stored status is the truth, since a gateway marks every `running` batch `partial` when it starts.

Neither kind of claim is what prevents duplicates: (batch, item, sample) and the trajectory id are unique
keys, so a sample stored twice (by an owner whose lock connection dropped, say) is refused by the database.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

_KEY_SPACE = b"sisrl-batch/"  # keeps our keys apart from other applications' advisory locks on the same database
_LOW32 = 0xFFFFFFFF
# pg_locks shows a bigint advisory key as its high 32 bits in `classid`, its low 32 bits in `objid`, and
# objsubid 1 (two-int4 keys have objsubid 2).
_HELD = text(
    "SELECT classid::bigint, objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
    "AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def lock_key(batch_id: str) -> int:
    """The advisory lock key of a batch: 63 bits of SHA-256, so it is a non-negative bigint."""
    digest = hashlib.sha256(_KEY_SPACE + batch_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def owned(session: Session, batch_ids: Sequence[str]) -> set[str] | None:
    """The batches of `batch_ids` that some process holds a claim on now; None where claims are not shared
    (SQLite: the stored status is the truth)."""
    bind = session.get_bind()
    if bind.dialect.name != "postgresql":
        return None
    held = {(hi << 32) | lo for hi, lo in session.execute(_HELD)}
    return {batch_id for batch_id in batch_ids if lock_key(batch_id) in held}


class Claims(Protocol):
    """A process's claims on batches; `try_claim` is atomic across every process that shares the store."""

    shared: bool

    def try_claim(self, batch_id: str) -> bool: ...

    def release(self, batch_id: str) -> None: ...

    def close(self) -> None: ...


class LocalClaims:
    """SQLite: one generating gateway per file, so a claim only has to exclude this process's other requests."""

    shared = False

    def __init__(self) -> None:
        self._held: set[str] = set()
        self._mutex = threading.Lock()

    def try_claim(self, batch_id: str) -> bool:
        with self._mutex:
            if batch_id in self._held:
                return False
            self._held.add(batch_id)
            return True

    def release(self, batch_id: str) -> None:
        with self._mutex:
            self._held.discard(batch_id)

    def close(self) -> None:
        with self._mutex:
            self._held.clear()


class PgClaims:
    """PostgreSQL: session advisory locks on one dedicated autocommit connection (never returned to the pool
    while this process lives, so its locks last exactly as long as the process)."""

    shared = True

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn: Connection = self._connect()
        self._held: set[str] = set()
        self._mutex = threading.Lock()  # one connection, used from the request and runner threads

    def _connect(self) -> Connection:
        return self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def _call(self, function: str, batch_id: str) -> bool:
        """`SELECT function(key)`; a dropped connection (database restart) is replaced once, and the claims it
        held are gone: another gateway may resume those batches too (unique keys keep it duplicate-free)."""
        query, params = text(f"SELECT {function}(:k)"), {"k": lock_key(batch_id)}
        try:
            return bool(self._conn.execute(query, params).scalar())
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            log.warning("the claim connection dropped (%s); claims lost on batches %s", exc.orig, sorted(self._held))
            self._held.clear()
            self._conn = self._connect()
            return bool(self._conn.execute(query, params).scalar())

    def try_claim(self, batch_id: str) -> bool:
        with self._mutex:
            # Session advisory locks stack within a session, so a batch this process holds must fail here.
            if batch_id in self._held:
                return False
            got = self._call("pg_try_advisory_lock", batch_id)
            if got:
                self._held.add(batch_id)
            return got

    def release(self, batch_id: str) -> None:
        with self._mutex:
            if batch_id in self._held:
                self._held.discard(batch_id)
                self._call("pg_advisory_unlock", batch_id)

    def close(self) -> None:
        with self._mutex:
            self._held.clear()
            if self._conn.closed:
                return
            # Close the DBAPI connection itself (not back to the pool, where a session would inherit the locks):
            # the server ends the session and drops every lock it held.
            self._conn.invalidate()
            self._conn.close()


def open_claims(sessions: sessionmaker[Session]) -> Claims:
    engine = _engine(sessions)
    return PgClaims(engine) if engine.dialect.name == "postgresql" else LocalClaims()


def _engine(sessions: sessionmaker[Session]) -> Engine:
    bind = sessions.kw["bind"]
    if not isinstance(bind, Engine):
        raise TypeError(f"expected a session factory bound to an Engine, got {type(bind).__name__}")
    return bind
