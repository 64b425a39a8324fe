"""The rollout store on a real SQLite file: exact round trip, compact arrays, filters, cursor pages, stats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sisrl.services import store
from sisrl.services.schemas import RewardParts, Trajectory, Turn


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
        timings={"total_s": 0.5}, error=None,
    )


def test_round_trip_filters_pages_stats(tmp_path: Path) -> None:
    sessions = store.open_db(f"sqlite:///{tmp_path / 'r.db'}")
    trajs = [_trajectory(i, step=i % 2, reward=float(i % 2), source="nq" if i < 4 else "hotpotqa") for i in range(6)]
    with sessions() as s:
        store.create_batch(session=s, batch_id="b1", run="r", step=0, idempotency_key="k", request_hash="h",
                           request_json="{}", total=6)
        for t in trajs:
            assert store.add_trajectory(session=s, trajectory=t, sample_index=0)
        assert not store.add_trajectory(session=s, trajectory=trajs[0], sample_index=0)  # no duplicate
        row = store.get_trajectory(session=s, trajectory_id="t2")
        assert row is not None
        assert store.to_trajectory(row) == trajs[2]
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
        assert store.done_samples(session=s, batch_id="b1") == {(f"q{i}", 0) for i in range(6)}
        assert store.mark_interrupted(session=s) == 1
        batch = store.get_batch(session=s, batch_id="b1")
        assert batch is not None and batch.status == "partial"
    with sessions() as s:
        mode = s.connection().exec_driver_sql("PRAGMA journal_mode").scalar()
    assert mode == "wal"
    store.dispose(sessions)


def test_sis_records_table_is_portable_to_postgres() -> None:
    """The same table definition serves Postgres (its DDL here; the routes were also run by hand on Postgres 15)."""
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.schema import CreateTable

    ddl = str(CreateTable(store.SisRecordRow.__table__).compile(dialect=postgresql.dialect()))  # type: ignore[arg-type]
    assert "status BYTEA NOT NULL" in ddl and "UNIQUE (trajectory_id, policy_version)" in ddl
    assert "FOREIGN KEY(trajectory_id) REFERENCES trajectories (id)" in ddl
