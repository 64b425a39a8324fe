"""Two gateways on one real PostgreSQL server (tests/utils/pg_cluster.py), each a real `sisrl-gateway serve` process
on loopback with the tiny policy: a batch submitted through both at once is one batch; listing, stats and batch
status read the same from either; and the fault drill: 64 trajectories through one gateway, that gateway
SIGKILLed mid-batch, the same idempotency key through the other. Every trajectory is then stored exactly once,
those finished before the kill untouched, and each byte-identical to what a clean run of the same request
stores (ids and timings aside)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sisrl.common.procs import free_port
from sisrl.services import store
from sisrl.services.runner import trajectory_id
from sqlalchemy import select

from tests.services.conftest import Gateway, GatewayFactory
from tests.utils.pg_cluster import Cluster

# One trajectory at a time per gateway: a slow enough batch to kill mid-way, and engine passes of one row, so
# a sample's floats do not depend on what else was in its batch (the clean run must match bit for bit).
OPTIONS = ("--engine", "local", "--max-concurrency", "1", "--max-pending", "256", "--max-response-tokens", "64",
           "--retriever-retries", "0")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # 2 shared cores: spinning intra-op threads slow tiny matmuls ~100x
SAMPLING = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "logprobs_k": 4, "seed": 11}
# Columns that name the batch or time the run; everything else a clean run must reproduce exactly.
NOT_REPRODUCED = {"seq", "id", "batch_id", "group_id", "timings", "created_at"}


@pytest.fixture(scope="module")
def replicas(pg_cluster: Cluster, start_gateway: GatewayFactory, tiny_policy_dir: Path) -> Iterator[list[Gateway]]:
    """Two gateways started together on one fresh database (they create its schema at the same time).

    The tiny random policy never completes a `<search>` within 8 tokens and one turn, so no retriever is
    called; the URL is a closed port (a search would end its trajectory with a transport error, identically
    in every run)."""
    db_url = pg_cluster.create_database()
    options = (*OPTIONS, "--model", str(tiny_policy_dir), "--retriever-url", f"http://127.0.0.1:{free_port()}")
    with ThreadPoolExecutor(2) as pool:
        gateways = list(pool.map(lambda _: start_gateway(*options, db_url=db_url, env=ONE_THREAD), range(2)))
    yield gateways
    for gateway in gateways:
        gateway.stop()


def _items(n: int) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "question": f"when did the isle of wight become an island? ({i})",
             "golden_answers": ["during the last Ice Age"], "data_source": "nq"} for i in range(n)]


def _together(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    barrier = threading.Barrier(len(calls))

    def go(call: Callable[[], httpx.Response]) -> httpx.Response:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(go, calls))


def _views(gateway: Gateway, run: str) -> tuple[Any, ...]:
    client = gateway.client
    return (client.get("/v1/rollouts", params={"run": run, "limit": 1000}).raise_for_status().json(),
            client.get(f"/v1/runs/{run}/stats").raise_for_status().json(),
            client.get("/v1/runs").raise_for_status().json())


def test_one_batch_per_key_through_any_replica(replicas: list[Gateway], make_body: Callable[..., dict[str, Any]]) -> None:
    a, b = replicas
    body = make_body(_items(3), run="race", samples_per_item=2, idempotency_key="race-1", sampling=SAMPLING,
                     max_turns=1)
    answers = _together([lambda: a.client.post("/v1/rollouts", json=body),
                         lambda: b.client.post("/v1/rollouts", json=body)])
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    (batch_id,) = {r.json()["batch_id"] for r in answers}  # the same batch through both
    batch = a.wait_batch(batch_id)
    assert batch["status"] == "done" and batch["progress"] == {"done": 6, "total": 6}
    assert b.client.get(f"/v1/batches/{batch_id}").json() == batch
    for gateway in (a, b):
        again = gateway.client.post("/v1/rollouts", json=body).raise_for_status().json()
        assert again == {"batch_id": batch_id, "status": "done"}
    conflict = b.client.post("/v1/rollouts", json={**body, "step": 1})
    assert conflict.status_code == 409 and "race-1" in conflict.json()["detail"]

    page, stats, runs = _views(a, "race")
    assert (page["count"], page["next_cursor"]) == (6, None)
    assert {(t["item_id"], t["batch_id"]) for t in page["data"]} == {(f"q{i}", batch_id) for i in range(3)}
    assert [(st["step"], st["trajectories"]) for st in stats["data"]] == [(0, 6)]
    assert _views(b, "race") == (page, stats, runs)


def _rows(db_url: str, batch_id: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Every stored column of the batch's trajectories, as the database holds them, by (item, sample)."""
    sessions = store.open_db(db_url)
    try:
        with sessions() as s:
            rows = s.scalars(select(store.TrajectoryRow).where(store.TrajectoryRow.batch_id == batch_id)).all()
            out = [{c.key: getattr(row, c.key) for c in store.TrajectoryRow.__table__.columns} for row in rows]
    finally:
        store.dispose(sessions)
    by_sample = {(r["item_id"], r["sample_index"]): r for r in out}
    assert len(by_sample) == len(out), "a (item, sample) is stored twice"
    return by_sample


def _finished(gateway: Gateway) -> float:
    """Trajectories this gateway process has generated (its Prometheus counter, over every label)."""
    lines = gateway.client.get("/metrics").raise_for_status().text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("sisrl_gateway_trajectories_total{"))


def _wait_status(gateway: Gateway, batch_id: str, wanted: str, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        body: dict[str, Any] = gateway.client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
        if body["status"] == wanted or time.monotonic() > deadline:
            assert body["status"] == wanted, body
            return body
        time.sleep(0.05)


def test_kill_one_replica_mid_batch_resume_through_the_other(replicas: list[Gateway],
                                                             make_body: Callable[..., dict[str, Any]]) -> None:
    a, b = replicas
    items = _items(16)
    clean = make_body(items, run="drill", step=3, samples_per_item=4, idempotency_key="drill-clean",
                      sampling=SAMPLING, max_turns=1)
    drill = {**clean, "idempotency_key": "drill-1"}  # the same request under another key: another batch
    generated_before = _finished(b)
    clean_id = b.client.post("/v1/rollouts", json=clean).raise_for_status().json()["batch_id"]
    drill_id = a.client.post("/v1/rollouts", json=drill).raise_for_status().json()["batch_id"]

    deadline = time.monotonic() + 60
    while a.client.get(f"/v1/batches/{drill_id}").json()["progress"]["done"] < 8:
        assert time.monotonic() < deadline, "the drill batch made no progress"
        time.sleep(0.02)
    # While A lives and holds the batch, B neither starts it nor calls it anything but running.
    assert b.client.post("/v1/rollouts", json=drill).json() == {"batch_id": drill_id, "status": "running"}
    assert b.client.get(f"/v1/batches/{drill_id}").json()["status"] == "running"
    a.stop(signal.SIGKILL)  # no shutdown hook runs: the batch stays `running` in the table

    # PostgreSQL drops the dead gateway's session and its advisory locks: B reports the batch interrupted.
    interrupted = _wait_status(b, drill_id, "partial", timeout_s=15)
    before = _rows(b.db_url, drill_id)
    assert 8 <= len(before) == interrupted["progress"]["done"] < 64, "A was not killed mid-batch"
    assert len(interrupted["missing_items"]) >= 1

    again = b.client.post("/v1/rollouts", json=drill).raise_for_status().json()
    assert again == {"batch_id": drill_id, "status": "running"}
    batch = b.wait_batch(drill_id, timeout=120)
    assert batch["status"] == "done" and batch["progress"] == {"done": 64, "total": 64}
    assert batch["missing_items"] == [] and len(batch["trajectories"]) == 64
    assert b.wait_batch(clean_id, timeout=120)["status"] == "done"
    # B generated the clean batch and the drill's missing samples, nothing more: while A lived, it started nothing.
    assert _finished(b) - generated_before == 64 + (64 - len(before))

    after, reference = _rows(b.db_url, drill_id), _rows(b.db_url, clean_id)
    samples = {(it["id"], s) for it in items for s in range(4)}
    assert set(after) == samples == set(reference)  # every trajectory exactly once (_rows refuses twins)
    assert all(after[key] == row for key, row in before.items())  # finished before the kill: untouched
    assert all(row["id"] == trajectory_id(drill_id, *key) for key, row in after.items())
    for key, row in after.items():
        mine = {k: v for k, v in row.items() if k not in NOT_REPRODUCED}
        assert mine == {k: v for k, v in reference[key].items() if k not in NOT_REPRODUCED}, key
    # The comparison has teeth: real sampled tokens with non-zero behaviour log-probs, different per sample.
    assert any(any(r["behaviour_logprobs"]) for r in after.values())
    assert len({r["response_ids"] for r in after.values()}) > 1
    assert {t["id"] for t in batch["trajectories"]} == {r["id"] for r in after.values()}
