"""The rollout store on a real SQLite file and on a real PostgreSQL server (tests/utils/pg_cluster.py), the same
tests on both: exact round trip, compact arrays, filters, cursor pages, stats, SIS records; and what lets
several gateways share one store: the unique keys decide concurrent writers, batch claims (advisory locks on
PostgreSQL) have one owner and die with its connection, and replicas can create the schema at the same time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sisrl.services import claims, sis_store, store
from sisrl.services.schemas import RewardParts, SisRecordIn, Trajectory, Turn
from sqlalchemy import func, select

BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh empty store: a SQLite file, or a new database on the session's PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'r.db'}"
    return str(request.getfixturevalue("pg_url"))


def _trajectory(i: int, *, step: int, reward: float, source: str = "nq", n: int = 12, k: int = 4) -> Trajectory:
    rng = np.random.default_rng(i)
    mask = [1] * 5 + [0] * 4 + [1] * (n - 9)
    # float32-representable values, so the stored float32 arrays round-trip exactly.
    logprobs = [float(np.float32(-rng.random())) if m else 0.0 for m in mask]
    topk_ids = [rng.integers(0, 49152, k).tolist() if m else [0] * k for m in mask]
    topk_lp = [sorted((np.float32(-rng.random(k))).tolist(), reverse=True) if m else [0.0] * k for m in mask]
    return Trajectory(
        id=f"t{i}", batch_id="b1", item_id=f"q{i}", group_id=f"g{i}", run="r", step=step, data_source=source,
        question="who?", golden_answers=["x", "y"], prompt_ids=[1, 2, 3], response_ids=rng.integers(0, 49152, n).tolist(),
        loss_mask=mask, behaviour_logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_lp,
        turns=[Turn(query="q", doc_ids=["7", "9"], scores=[0.5, 0.25])], finish_reason="answer", answer="x",
        reward=reward, reward_parts=RewardParts(em=reward, f1=reward, format=1.0), policy_version=3,
        # a weight load after the first turn: the second turn's tokens are version 4's (partial rollouts)
        token_versions=[3] * 5 + [-1] * 4 + [4] * (n - 9), timings={"total_s": 0.5}, error=None,
    )


def _batch(s: Any, batch_id: str = "b1", key: str | None = "k") -> store.BatchRow:
    return store.create_batch(session=s, batch_id=batch_id, run="r", step=0, idempotency_key=key, request_hash="h",
                              request_json="{}", total=6)


def test_round_trip_filters_pages_stats(db_url: str) -> None:
    sessions = store.open_db(db_url)
    trajs = [_trajectory(i, step=i % 2, reward=float(i % 2), source="nq" if i < 4 else "hotpotqa") for i in range(6)]
    with sessions() as s:
        _batch(s)
        for t in trajs:
            assert store.add_trajectory(session=s, trajectory=t, sample_index=0)
        assert not store.add_trajectory(session=s, trajectory=trajs[0], sample_index=0)  # no duplicate
        row = store.get_trajectory(session=s, trajectory_id="t2")
        assert row is not None
        assert store.to_trajectory(row) == trajs[2]
        assert store.to_summary(row).policy_version_max == 4  # the newest version among its tokens
        assert len(row.response_ids) == 4 * 12 and len(row.loss_mask) == 12 and len(row.topk_logprobs) == 4 * 12 * 4

        rows, nxt = store.list_trajectories(session=s, run="r", reward_min=1.0)
        assert [r.id for r in rows] == ["t1", "t3", "t5"] and nxt is None
        rows, _ = store.list_trajectories(session=s, data_source="hotpotqa", step_max=0)
        assert [r.id for r in rows] == ["t4"]
        pages, cursor = [], 0
        while True:
            rows, nxt = store.list_trajectories(session=s, after_seq=cursor, limit=4)
            pages.append([r.id for r in rows])
            if nxt is None:
                break
            cursor = nxt
        assert pages == [["t0", "t1", "t2", "t3"], ["t4", "t5"]]

        stats = store.run_stats(session=s, run="r")
        # step 0: t0, t2 (nq, reward 0), t4 (hotpotqa, reward 0); step 1: t1, t3 (nq, 1), t5 (hotpotqa, 1).
        assert [(st.step, st.trajectories, st.reward_mean) for st in stats] == [(0, 3, 0.0), (1, 3, 1.0)]
        assert stats[1].em_by_source == {"hotpotqa": 1.0, "nq": 1.0} and stats[0].searches_mean == 1.0
        (run,) = store.list_runs(session=s)
        assert (run.run, run.trajectories, run.steps, run.first_step, run.last_step) == ("r", 6, 2, 0, 1)
        assert store.done_samples(session=s, batch_id="b1") == {(f"q{i}", 0) for i in range(6)}
        _batch(s, "b2", key=None)
        assert store.mark_interrupted(session=s, batch_ids=["b2"]) == 1  # only the batches named
        assert store.batch_status(session=s, batch_id="b1") == "running"
        assert store.mark_interrupted(session=s) == 1
        assert store.batch_status(session=s, batch_id="b1") == "partial"
    with sessions() as s:
        if db_url.startswith("sqlite"):
            assert s.connection().exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        else:
            assert s.connection().dialect.name == "postgresql"
    store.dispose(sessions)


def test_a_store_from_before_token_versions_is_upgraded_in_place(db_url: str) -> None:
    """A store written before `token_versions` existed gains the column at open; its old rows read every policy
    token as the trajectory's policy_version (-1 at inserted tokens)."""
    sessions = store.open_db(db_url)
    t = _trajectory(0, step=0, reward=1.0)
    with sessions() as s:
        _batch(s)
        assert store.add_trajectory(session=s, trajectory=t, sample_index=0)
        conn = s.connection()
        conn.exec_driver_sql("ALTER TABLE trajectories DROP COLUMN token_versions")
        conn.exec_driver_sql("ALTER TABLE trajectories DROP COLUMN policy_version_max")
        s.commit()
    store.dispose(sessions)
    sessions = store.open_db(db_url)  # the old layout: the columns come back, empty
    with sessions() as s:
        row = store.get_trajectory(session=s, trajectory_id="t0")
        assert row is not None and row.token_versions is None
        read = store.to_trajectory(row)
        assert read.token_versions == [3 if m else -1 for m in t.loss_mask]
        assert store.to_summary(row).policy_version_max == 3
    store.dispose(sessions)


def test_sis_records_round_trip_and_stats(db_url: str) -> None:
    sessions = store.open_db(db_url)
    t = _trajectory(0, step=0, reward=1.0)
    # mask [1]*5 + [0]*4 + [1]*3: decisions on the 8 policy tokens, -1 on the 4 inserted ones.
    status = [1, 0, 2, 1, 1, -1, -1, -1, -1, 0, 1, 1]
    logp = [lq - 0.5 if m else 0.0 for lq, m in zip(t.behaviour_logprobs, t.loss_mask, strict=True)]
    record = SisRecordIn(trajectory_id=t.id, policy_version=4, advantage=0.5, status=status, ratio=[1.0] * 12,
                         logp=logp, log_m=[0.25] * 12)
    with sessions() as s:
        _batch(s)
        store.add_trajectory(session=s, trajectory=t, sample_index=0)
        assert sis_store.put_records(session=s, run="r", step=2, records=[record]) == (1, 0)
        assert sis_store.put_records(session=s, run="r", step=2, records=[record]) == (1, 1)  # replaced
        row = sis_store.newest_record(session=s, trajectory_id=t.id)
        assert row is not None
        public = sis_store.to_public(row)
        assert public.status == status and public.logp == pytest.approx(logp, abs=1e-6)
        # 8 decided tokens, |l_t| = 0.5 each: D = 4.0; rejected or outside: positions 1, 2, 9, so D_SIS = 1.5.
        assert (public.summary.accepted, public.summary.rejected, public.summary.outside) == (5, 2, 1)
        assert public.summary.d == pytest.approx(4.0, abs=1e-5) and public.summary.d_sis == pytest.approx(1.5, abs=1e-5)
        (st,) = sis_store.step_stats(session=s, run="r")
        assert (st.step, st.records, st.policy_tokens, st.accept_rate) == (2, 1, 8, 5 / 8)
    store.dispose(sessions)


def _in_threads(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run fn(0..n-1) in n threads released together."""
    barrier = threading.Barrier(n)

    def go(i: int) -> Any:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(go, range(n)))


def test_unique_keys_decide_concurrent_writers(db_url: str) -> None:
    """Writers through separate engines (as separate gateway processes would be): one batch per idempotency key,
    one row per (batch, item, sample); the losers get the winner's batch, or False, never an error."""
    replicas = [store.open_db(db_url) for _ in range(4)]
    try:
        def submit(i: int) -> str:
            with replicas[i]() as s:
                return _batch(s, f"batch-{i}", key="same-key").id

        winners = _in_threads(4, submit)
        assert len(set(winners)) == 1 and winners[0] in {f"batch-{i}" for i in range(4)}
        t = _trajectory(0, step=0, reward=0.0).model_copy(update={"batch_id": winners[0]})

        def store_sample(i: int) -> bool:
            with replicas[i]() as s:
                return store.add_trajectory(session=s, trajectory=t, sample_index=0)

        assert sorted(_in_threads(4, store_sample)) == [False, False, False, True]
        with replicas[0]() as s:
            assert s.scalar(select(func.count()).select_from(store.BatchRow)) == 1
            assert s.scalar(select(func.count()).select_from(store.TrajectoryRow)) == 1
    finally:
        for sessions in replicas:
            store.dispose(sessions)


def test_replicas_create_the_schema_together(pg_url: str) -> None:
    """PostgreSQL only: gateways sharing a database may start at once (a SQLite file has one generating gateway)."""
    replicas = _in_threads(3, lambda _: store.open_db(pg_url))
    with replicas[1]() as s:
        assert s.scalar(select(func.count()).select_from(store.TrajectoryRow)) == 0
    for sessions in replicas:
        store.dispose(sessions)


def test_batch_claims_have_one_owner_and_die_with_it(db_url: str) -> None:
    a_sessions, b_sessions = store.open_db(db_url), store.open_db(db_url)
    a, b = claims.open_claims(a_sessions), claims.open_claims(b_sessions)
    try:
        assert a.try_claim("b1") and not a.try_claim("b1")  # held: not even this process may take it twice
        if not db_url.startswith("postgresql"):  # SQLite: in-process claims; the stored status is the truth
            assert b.try_claim("b1") and not a.shared
            with a_sessions() as s:
                assert claims.owned(s, ["b1"]) is None
            return
        assert not b.try_claim("b1")  # another process (connection) cannot take it
        with b_sessions() as s:
            assert claims.owned(s, ["b1", "b2"]) == {"b1"}
        a.release("b1")
        with b_sessions() as s:
            assert claims.owned(s, ["b1"]) == set()
        assert b.try_claim("b1") and b.try_claim("b2")
        b.close()  # the owner's connection ends (a killed gateway): its server process exits, dropping the locks
        deadline = time.monotonic() + 10
        while True:
            with a_sessions() as s:
                left = claims.owned(s, ["b1", "b2"])
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert left == set()
        assert a.try_claim("b2")
    finally:
        a.close()
        b.close()
        store.dispose(a_sessions)
        store.dispose(b_sessions)


def test_lock_keys_are_stable_non_negative_bigints() -> None:
    keys = {claims.lock_key(f"batch-{i}") for i in range(1000)}
    assert len(keys) == 1000 and all(0 <= k < 2**63 for k in keys)
    assert claims.lock_key("b1") == claims.lock_key("b1")


def test_an_unreachable_store_is_named_without_its_password(tmp_path: Path) -> None:
    from sisrl.common.procs import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(store.StoreUnavailable) as refused:
        store.open_db(f"postgresql+psycopg://sisrl:hunter22@127.0.0.1:{port}/rollouts")
    text = str(refused.value)
    assert text.startswith(f"cannot open the rollout store postgresql+psycopg://sisrl:***@127.0.0.1:{port}/rollouts: ")
    assert "hunter22" not in text and "\n" not in text
    with pytest.raises(store.StoreUnavailable, match="unable to open database file"):
        store.open_db(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}")
