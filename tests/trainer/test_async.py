"""Asynchronous training through real servers (`sisrl-retriever serve`, `sisrl-gateway serve` with the local
engine and the tiny policy, on loopback): the staleness bound read back from what the trainer trained on, the
per-token versions of partial rollouts, and a resume that neither loses nor repeats a batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.trainer.config import ConfigError, TrainConfig, config_from_dict
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.loop import train
from sisrl.trainer.procs import Service, launch_gateway, launch_retriever, wait_healthy


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Service]]:
    root = tmp_path_factory.mktemp("async")
    data = write_demo_data(root / "data", seed=2, people=12, towns=4)
    tokenizer = load_tokenizer()
    initial = root / "initial"
    build_tiny_policy(tokenizer, seed=0).save_pretrained(initial, safe_serialization=True)
    tokenizer.save_pretrained(initial)
    retriever = launch_retriever(index_dir=root / "index", corpus=data["corpus"], encoder="minilm",
                                 log=root / "retriever.log")
    gateway = launch_gateway(model=str(initial), retriever_url=retriever.url, db=root / "rollouts.db",
                             checkpoint_root=root, log=root / "gateway.log",
                             extra=["--max-response-tokens", "128", "--observation-max-tokens", "28"])
    wait_healthy(retriever, gateway)
    try:
        yield data["train"], root, gateway
    finally:
        gateway.stop()
        retriever.stop()


def _config(train_file: Path, root: Path, gateway: Service, run: str, **rollout: Any) -> TrainConfig:
    return config_from_dict({
        "run_dir": str(root / run), "total_steps": 4, "tensorboard": False, "progress": False, "device": "cpu",
        "model": {"path": str(root / "initial")},
        "data": {"train": [{"path": str(train_file)}]},
        "rollout": {"gateway_url": gateway.url, "prompts_per_step": 2, "samples_per_prompt": 2,
                    "max_new_tokens": 24, "max_turns": 3, "timeout_s": 240, "poll_interval_s": 0.05, **rollout},
        # reward 0 everywhere for a random policy: the entropy bonus makes every update move the weights
        "algorithm": {"loss": "grpo", "ratio": "sis", "logprobs_k": 5, "staleness": 2, "entropy_coef": 0.01},
        "optim": {"lr": 1e-3},
    })


def _trained(gateway: Service, run_dir: Path) -> list[dict[str, Any]]:
    """Every stored trajectory of the run with the SIS record the trainer posted when it trained on it."""
    run = (run_dir / "run_name.txt").read_text().strip()
    page = httpx.get(f"{gateway.url}/v1/rollouts", params={"run": run, "limit": 1000}).json()
    return [httpx.get(f"{gateway.url}/v1/rollouts/{t['id']}").json() for t in page["data"]]


@pytest.mark.parametrize("k", [1, 2])
def test_no_trained_token_lags_more_than_k_versions(servers: tuple[Path, Path, Service], k: int) -> None:
    train_file, root, gateway = servers
    torch.set_num_threads(1)
    cfg = _config(train_file, root, gateway, f"bound{k}", mode="async", max_staleness=k, partial=True)
    history = train(cfg)
    assert len(history) == 4
    details = _trained(gateway, Path(cfg.run_dir))
    assert len(details) == 4 * 4  # k batches ahead of step 4 would be past total_steps: none submitted
    lags = []
    for d in details:
        versions, mask = d["token_versions"], d["loss_mask"]
        assert [v == -1 for v in versions] == [m == 0 for m in mask]  # inserted passages carry no version
        policy = [v for v in versions if v >= 0]
        assert policy == sorted(policy)  # a load only ever makes later tokens newer
        sis = d["sis"]
        assert sis is not None, d["id"]  # every stored trajectory was trained on ...
        assert sis["step"] == d["step"]  # ... at the step it was submitted for
        lags += [sis["policy_version"] - v for v in policy]
        assert d["policy_version"] >= d["step"] - k  # min_policy_version held at the gateway
    assert 0 <= min(lags) and max(lags) <= k, sorted(set(lags))
    assert max(lags) >= 1  # the run was asynchronous: something was trained stale
    assert all(h["staleness/lag_max"] <= k and h["staleness/dropped"] == 0 for h in history)
    for key in ("staleness/lag_mean", "staleness/multi_version_share", "rollout_corr/kl", "rollout_corr/k3_kl",
                "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"):
        assert key in history[-1], key
    assert any("staleness/accept_rate_lag1" in h for h in history)  # SIS diagnostics split by lag


def test_resume_in_async_mode_trains_each_batch_once(servers: tuple[Path, Path, Service]) -> None:
    """Stop after step 2 with batches 2 and 3 in flight; the resumed run finds them by their idempotency keys."""
    train_file, root, gateway = servers
    torch.set_num_threads(1)
    cfg = _config(train_file, root, gateway, "resume", mode="async", max_staleness=2, partial=True)
    assert len(train(cfg, stop_after=2)) == 2
    ckpt_state = (Path(cfg.run_dir) / "checkpoints" / "step_000002" / "trainer_state.json").read_text()
    assert '"inflight"' in ckpt_state and ":2" in ckpt_state and ":3" in ckpt_state
    assert len(train(cfg)) == 2
    details = _trained(gateway, Path(cfg.run_dir))
    by_step: dict[int, set[str]] = {}
    for d in details:
        by_step.setdefault(d["step"], set()).add(d["batch_id"])
        assert d["sis"] is not None and d["sis"]["step"] == d["step"], d["id"]
    assert sorted(by_step) == [0, 1, 2, 3]
    assert all(len(batches) == 1 for batches in by_step.values()), by_step  # no batch submitted twice
    assert len(details) == 16  # each trajectory stored once, and each trained (its SIS record) once
    run = (Path(cfg.run_dir) / "run_name.txt").read_text().strip()
    stats = httpx.get(f"{gateway.url}/v1/runs/{run}/sis_stats").json()
    assert [(s["step"], s["records"]) for s in stats["data"]] == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_bad_async_settings_fail_at_config_load(servers: tuple[Path, Path, Service]) -> None:
    train_file, root, gateway = servers
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=-1: must be >= 0"):
        _config(train_file, root, gateway, "bad", mode="async", max_staleness=-1)
    with pytest.raises(ConfigError, match=r"rollout.mode=async needs rollout.source=gateway"):
        config_from_dict({"rollout": {"source": "synthetic", "mode": "async"}})
