"""Failure handling: a retriever that returns 503 then recovers, stays down, or is dead; a gateway killed
mid-batch (stored trajectories intact, missing items reported, idempotent resubmit); 429 when full."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Response

SCRIPT = {"rules": [{"match": "", "turns": ["<search>isle of wight</search>", "<answer>ice age</answer>"]}]}


class FlakyRetriever:
    """A stub Search-R1 retriever (failure-handling tests only): 503 for the first `fail_first` calls."""

    def __init__(self, port: int) -> None:
        self.calls = 0
        self.fail_first = 0
        app = FastAPI()

        @app.post("/retrieve")
        def retrieve(body: dict[str, Any]) -> Response:
            self.calls += 1
            if self.calls <= self.fail_first:
                return Response("overloaded", status_code=503)
            hits = [[{"document": {"id": "1", "contents": '"Isle of Wight"\nAn island.'}, "score": 0.9}]
                    for _ in body["queries"]]
            return Response(json.dumps({"result": hits}), media_type="application/json")

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def flaky(free_port_fn: Callable[[], int]) -> Iterator[FlakyRetriever]:
    stub = FlakyRetriever(free_port_fn())
    yield stub
    stub.stop()


def _item(i: int) -> dict[str, Any]:
    return {"id": f"q{i}", "question": f"when did the isle of wight become an island {i}",
            "golden_answers": ["during the last Ice Age"], "data_source": "nq"}


def test_retriever_503_recovers_then_down_then_dead(flaky: FlakyRetriever, start_gateway: Callable[..., Any],
                                                    make_body: Callable[..., dict[str, Any]],
                                                    tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    gateway = start_gateway("--engine", "scripted", "--script", str(script), "--retriever-url",
                            f"http://127.0.0.1:{flaky.server.config.port}", "--retriever-retries", "3",
                            "--retriever-backoff-s", "0.05", "--retriever-timeout-s", "5")
    sampling = {"max_new_tokens": 64, "logprobs_k": 3}

    def run_one(run: str) -> dict[str, Any]:
        body = make_body([_item(0)], run=run, sampling=sampling, max_turns=3)
        return dict(gateway.wait_batch(gateway.client.post("/v1/rollouts", json=body).json()["batch_id"]))

    assert flaky.calls == 1  # the start-up check: one query, answered before the gateway's /health
    flaky.calls, flaky.fail_first = 0, 2  # two 503s, then answers: retries absorb them
    batch = run_one("flaky")
    (traj,) = batch["trajectories"]
    assert (batch["status"], traj["finish_reason"], traj["error"], traj["reward"]) == ("done", "answer", None, 0.0)
    assert traj["turns"] == [{"query": "isle of wight", "doc_ids": ["1"], "scores": [0.9]}] and flaky.calls == 3

    flaky.calls, flaky.fail_first = 0, 100  # down for good: 4 attempts, then a recorded error
    batch = run_one("down")
    (traj,) = batch["trajectories"]
    assert batch["status"] == "failed" and traj["finish_reason"] == "error" and flaky.calls == 4
    assert "retriever" in traj["error"] and "after 4 attempts" in traj["error"] and "HTTP 503" in traj["error"]

    flaky.stop()  # dead: connection refused
    batch = run_one("dead")
    (traj,) = batch["trajectories"]
    assert traj["finish_reason"] == "error" and "transport error" in traj["error"]
    assert len(traj["response_ids"]) == len(traj["loss_mask"]) > 0  # what was sampled is kept
    metrics = gateway.client.get("/metrics").text
    assert 'sisrl_gateway_retriever_requests_total{outcome="error"} 10.0' in metrics


def test_kill_restart_resume_and_429(start_gateway: Callable[..., Any], tiny_policy_dir: Path,
                                     retriever_url: str, make_body: Callable[..., dict[str, Any]]) -> None:
    options = ("--engine", "local", "--model", str(tiny_policy_dir), "--retriever-url", retriever_url,
               "--max-concurrency", "1", "--max-pending", "4", "--max-response-tokens", "256")
    gateway = start_gateway(*options)
    items = [_item(i) for i in range(4)]
    body = make_body(items, run="persist", max_turns=2, idempotency_key="persist-1",
                     sampling={"max_new_tokens": 32, "logprobs_k": 4, "seed": 5})
    batch_id = gateway.client.post("/v1/rollouts", json=body).raise_for_status().json()["batch_id"]

    full = gateway.client.post("/v1/rollouts", json=make_body([_item(9)], run="overflow"))
    assert full.status_code == 429 and full.headers["retry-after"] == "1" and "max_pending=4" in full.json()["detail"]
    assert "sisrl_gateway_rejected_batches_total 1.0" in gateway.client.get("/metrics").text

    while gateway.client.get(f"/v1/batches/{batch_id}").json()["progress"]["done"] < 1:
        time.sleep(0.02)
    gateway.stop(signal.SIGKILL)  # no shutdown hook runs
    restarted = start_gateway(*options, db_url=gateway.db_url)
    client = restarted.client
    # GET /v1/rollouts/{id} adds `sis` (the trainer's SIS record; none here) to the trajectory fields
    before = {t["id"]: client.get(f"/v1/rollouts/{t['id']}").json()
              for t in client.get("/v1/rollouts", params={"run": "persist"}).json()["data"]}
    assert all(t.pop("sis") is None for t in before.values())
    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "partial" and batch["trajectories"] is None
    assert 1 <= batch["progress"]["done"] == len(before) < 4
    done_items = {t["item_id"] for t in before.values()}
    assert batch["missing_items"] == [it["id"] for it in items if it["id"] not in done_items]
    assert all(len(t["response_ids"]) == len(t["loss_mask"]) > 0 for t in before.values())

    conflict = client.post("/v1/rollouts", json={**body, "step": 1})
    assert conflict.status_code == 409
    again = client.post("/v1/rollouts", json=body).raise_for_status().json()
    assert again == {"batch_id": batch_id, "status": "running"}
    batch = restarted.wait_batch(batch_id)
    assert batch["status"] == "done" and batch["progress"] == {"done": 4, "total": 4} and batch["missing_items"] == []
    after = {t["id"]: t for t in batch["trajectories"]}
    assert len(after) == 4 and all(after[tid] == traj for tid, traj in before.items())  # untouched
    assert client.post("/v1/rollouts", json=body).json() == {"batch_id": batch_id, "status": "done"}
    assert client.get("/v1/rollouts", params={"run": "persist"}).json()["count"] == 4
