"""A gateway SIGKILLed while the trainer waits on a batch, and started again on the same SQLite store and port:
the run completes through real servers (`sisrl-retriever serve`, `sisrl-gateway serve` with the local engine and
the tiny policy, on loopback), every step trained once on a whole batch, and the store holds each trajectory
once. The trainer retries the dead gateway, pushes its newest policy again to the restarted one (it starts on
its `--model` weights) and resubmits the batch's idempotency key, so only the missing samples run."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.trainer.config import config_from_dict
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.loop import train
from sisrl.trainer.metrics import read_metrics
from sisrl.trainer.procs import Service, free_port, launch_gateway, launch_retriever, wait_healthy

PROMPTS, SAMPLES, STEPS = 2, 2, 2
BATCH = PROMPTS * SAMPLES


def _stored(url: str, run: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/v1/rollouts", params={"run": run, "limit": 1000}, timeout=5).json()["data"])


def _kill_during_second_batch(gateway: Service, run_dir: Path, restart: Any, out: dict[str, Any]) -> None:
    """SIGKILL the gateway once batch 1 has stored some but not all of its trajectories; start it again."""
    while not (run_dir / "run_name.txt").is_file():
        time.sleep(0.05)
    run = (run_dir / "run_name.txt").read_text().strip()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            stored = len(_stored(gateway.url, run))
        except httpx.HTTPError:
            stored = 0
        if BATCH < stored < 2 * BATCH:
            gateway.stop(sig=signal.SIGKILL)  # no shutdown hook runs
            out["stored_at_kill"] = stored
            out["gateway"] = restart()
            return
        time.sleep(0.05)


@pytest.mark.timeout(600)  # three process starts (the gateway twice) and two steps on CPU
def test_a_gateway_killed_mid_batch_and_restarted_loses_and_repeats_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = write_demo_data(tmp_path / "data", seed=3, people=12, towns=4)
    tokenizer = load_tokenizer()
    initial = tmp_path / "initial"
    build_tiny_policy(tokenizer, seed=0).save_pretrained(initial, safe_serialization=True)
    tokenizer.save_pretrained(initial)
    retriever = launch_retriever(index_dir=tmp_path / "index", corpus=data["corpus"], encoder="minilm",
                                 log=tmp_path / "retriever.log")
    port = free_port()

    def start() -> Service:
        # one trajectory at a time, so the kill lands inside a batch
        return launch_gateway(model=str(initial), retriever_url=retriever.url, db=tmp_path / "rollouts.db",
                              checkpoint_root=tmp_path, log=tmp_path / "gateway.log", port=port,
                              extra=["--max-response-tokens", "96", "--observation-max-tokens", "72",
                                     "--max-concurrency", "1"])

    gateway = start()
    out: dict[str, Any] = {}
    try:
        wait_healthy(retriever, gateway)
        run_dir = tmp_path / "run"
        cfg = config_from_dict({
            "run_dir": str(run_dir), "total_steps": STEPS, "tensorboard": False, "progress": False, "device": "cpu",
            "model": {"path": str(initial)}, "data": {"train": [{"path": str(data["train"])}]},
            "rollout": {"gateway_url": gateway.url, "prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
                        "max_new_tokens": 12, "max_turns": 2, "timeout_s": 240, "poll_interval_s": 0.1,
                        "retry_budget_s": 120},
            # reward 0 everywhere for a random policy: the entropy bonus makes every update move the weights
            "algorithm": {"loss": "grpo", "ratio": "sis", "logprobs_k": 5, "staleness": 1, "entropy_coef": 0.01},
            "optim": {"lr": 1e-3},
        })
        killer = threading.Thread(target=_kill_during_second_batch,
                                  args=(gateway, run_dir, lambda: _healthy(start()), out), daemon=True)
        killer.start()
        torch.set_num_threads(1)
        with caplog.at_level(logging.WARNING, logger="sisrl.trainer.gateway_client"):
            history = train(cfg)
        killer.join(timeout=60)
        assert "stored_at_kill" in out, "the kill never landed inside batch 1"
        gateway = out["gateway"]

        # every step trained once, each on its whole batch at its own policy version
        rows = read_metrics(run_dir)
        assert len(history) == STEPS and [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert [(r["rollout/trajectories"], r["rollout/errors"], r["staleness/dropped"]) for r in rows] == \
            [(BATCH, 0.0, 0.0)] * STEPS
        resumed = [r.getMessage() for r in caplog.records if "submitting its idempotency key" in r.getMessage()]
        assert len(resumed) == 1 and ":1' again" in resumed[0]
        assert any("pushing it again" in r.getMessage() for r in caplog.records)  # version 1 on the new gateway

        # the store holds each trajectory once: one batch per step, every (item, group) sample count exact
        run = (run_dir / "run_name.txt").read_text().strip()
        stored = _stored(gateway.url, run)
        assert len(stored) == STEPS * BATCH and len({t["id"] for t in stored}) == len(stored)
        by_step = Counter((t["step"], t["batch_id"]) for t in stored)
        assert sorted(by_step.values()) == [BATCH] * STEPS and sorted(s for s, _ in by_step) == list(range(STEPS))
        assert all(t["policy_version"] == t["step"] for t in stored)  # resumed samples: the re-pushed version 1
        (killed,) = [b for s, b in by_step if s == 1]
        batch = httpx.get(f"{gateway.url}/v1/batches/{killed}").json()
        assert batch["status"] == "done" and batch["progress"] == {"done": BATCH, "total": BATCH}
        assert httpx.get(f"{gateway.url}/health").json()["policy_version"] == STEPS
    finally:
        (out.get("gateway") or gateway).stop()
        retriever.stop()


def _healthy(service: Service) -> Service:
    wait_healthy(service)
    return service
