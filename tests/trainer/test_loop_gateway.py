"""One full training step through real servers: `sisrl-retriever serve` and `sisrl-gateway serve` (local engine,
the tiny policy) as subprocesses on loopback. Checks that the weights change, the policy version increments,
the gateway reports the new version, and the metrics are written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.common.shards import iter_safetensors
from sisrl.trainer.cli import main as cli_main
from sisrl.trainer.config import ConfigError, config_from_dict
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.loop import train
from sisrl.trainer.metrics import read_metrics
from sisrl.trainer.procs import Service, launch_gateway, launch_retriever, wait_healthy


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Service, Path]]:
    root = tmp_path_factory.mktemp("loop")
    data = write_demo_data(root / "data", seed=1, people=12, towns=4)
    run_dir = root / "run"
    initial = run_dir / "initial"
    tokenizer = load_tokenizer()
    build_tiny_policy(tokenizer, seed=0).save_pretrained(initial, safe_serialization=True)
    tokenizer.save_pretrained(initial)
    retriever = launch_retriever(index_dir=root / "index", corpus=data["corpus"], encoder="minilm",
                                 log=root / "retriever.log")
    gateway = launch_gateway(model=str(initial), retriever_url=retriever.url, db=root / "rollouts.db",
                             checkpoint_root=run_dir, log=root / "gateway.log",
                             extra=["--max-response-tokens", "96", "--observation-max-tokens", "72"])
    wait_healthy(retriever, gateway)  # started together: the gateway needs the retriever only per search
    try:
        yield data["train"], run_dir, gateway, data["test"]
    finally:
        gateway.stop()
        retriever.stop()


def test_one_step_through_retriever_and_gateway(servers: tuple[Path, Path, Service, Path]) -> None:
    train_file, run_dir, gateway, _ = servers
    assert httpx.get(f"{gateway.url}/health").json()["policy_version"] == 0
    cfg = config_from_dict({
        "run_dir": str(run_dir), "total_steps": 1, "tensorboard": True, "progress": False, "device": "cpu",
        "model": {"path": str(run_dir / "initial")},
        "data": {"train": [{"path": str(train_file)}]},
        "rollout": {"gateway_url": gateway.url, "prompts_per_step": 2, "samples_per_prompt": 2,
                    "max_new_tokens": 12, "max_turns": 2, "timeout_s": 240, "poll_interval_s": 0.2},
        # A random tiny policy earns reward 0 everywhere (all advantages 0); the entropy bonus makes the update
        # move the weights regardless, so the test can see new weights reach the gateway.
        "algorithm": {"loss": "grpo", "ratio": "sis", "logprobs_k": 5, "staleness": 2, "entropy_coef": 0.01},
        "optim": {"lr": 1e-3},
    })
    torch.set_num_threads(1)
    history = train(cfg)

    assert len(history) == 1
    health = httpx.get(f"{gateway.url}/health").json()
    assert health["policy_version"] == 1
    pushed = run_dir / "policy" / "v000001"
    assert httpx.get(f"{gateway.url}/v1/policy").json()["path"] == str(pushed.resolve())
    before = load_file(str(run_dir / "initial" / "model.safetensors"))
    after = dict(iter_safetensors(pushed))  # the push's shards, through its index
    assert after.keys() == before.keys()
    # model.push_dtype auto: the dtype the gateway's engine serves in, as its /health says
    assert {str(t.dtype).removeprefix("torch.") for t in after.values()} == {health["weights_dtype"]}
    moved = max(float((after[k].float() - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # Adam's first step moves every touched weight by ~lr = 1e-3

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1]
    row = rows[0]
    for key in ("reward/mean", "sis/accept_rate", "sis/D", "sis/D_sis", "sis/xi_k", "loss/clipfrac",
                "actor/grad_norm", "actor/entropy", "rollout/searches_per_traj", "rollout/response_len",
                "perf/rollout_tokens_per_s", "time/rollout_s", "time/update_s", "time/sync_s"):
        assert key in row and row[key] is not None, key
    assert row["policy/version"] == 1.0
    assert row["sis/D_sis"] <= row["sis/D"] + 1e-9
    assert any(k.startswith("reward/em/") for k in row)
    assert list((run_dir / "tensorboard").iterdir())
    state = json.loads((run_dir / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["policy_version"] == 1 and state["sampler"]["drawn"] == 2
    recorded = json.loads((run_dir / "gateway.json").read_text())  # what no request carries, for eval
    assert recorded == health["rollout"] and recorded["max_response_tokens"] == 96

    # The trainer posted its per-token SIS outcome of every trained trajectory (sis_records defaults on).
    run = (run_dir / "run_name.txt").read_text().strip()
    page = httpx.get(f"{gateway.url}/v1/rollouts", params={"run": run, "limit": 50}).json()
    ids = [t["id"] for t in page["data"]]
    assert len(ids) == 4
    accepted = decided = 0
    for tid in ids:
        detail = httpx.get(f"{gateway.url}/v1/rollouts/{tid}").json()
        sis = detail["sis"]
        assert sis is not None and sis["policy_version"] == 0, tid
        assert len(sis["status"]) == len(detail["response_ids"])
        # -1 exactly at inserted tokens; a decision (accepted 1 / rejected 0 / outside 2) at every policy token
        assert [s == -1 for s in sis["status"]] == [m == 0 for m in detail["loss_mask"]]
        accepted += sis["summary"]["accepted"]
        decided += sis["summary"]["accepted"] + sis["summary"]["rejected"] + sis["summary"]["outside"]
    assert decided == sum(sum(httpx.get(f"{gateway.url}/v1/rollouts/{t}").json()["loss_mask"]) for t in ids)
    assert accepted / decided == pytest.approx(row["sis/accept_rate"], abs=0.05)  # means of micro-batches vs pooled


def test_eval_exports_a_checkpoint_and_reports_em_per_source(servers: tuple[Path, Path, Service, Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    _, run_dir, gateway, test_file = servers
    ckpt = run_dir / "checkpoints" / "step_000001"
    assert cli_main(["eval", "--checkpoint", str(ckpt), "--data", str(test_file), "--gateway-url", gateway.url,
                     "--limit", "3", "--max-new-tokens", "8", "--max-turns", "1", "--logprobs-k", "5"]) == 0
    captured = capsys.readouterr()
    assert "eval/em/" in captured.out and "eval/count/" in captured.out
    # One line: the flags given, the rest from the run (checkpoint's config), and its gateway's settings unchanged.
    assert "max_turns=1 (flag) max_new_tokens=8 (flag) top_p=1.0 (run) logprobs_k=5 (flag) seed=0 (run)" in captured.err
    assert "max_response_tokens=96 format_weight=0.0, as in the run" in captured.err
    assert (ckpt / "hf" / "model.safetensors").is_file()
    exported = load_file(str(ckpt / "hf" / "model.safetensors"))
    pushed = dict(iter_safetensors(run_dir / "policy" / "v000001"))  # sharded, through its index
    assert pushed.keys() <= exported.keys()
    assert all(torch.equal(exported[k].to(pushed[k].dtype), pushed[k]) for k in pushed)  # the pushed policy
    assert httpx.get(f"{gateway.url}/v1/policy").json()["path"] == str((ckpt / "hf").resolve())


def test_a_gateway_that_would_truncate_the_configs_trajectories_is_refused(
        servers: tuple[Path, Path, Service, Path], tmp_path: Path) -> None:
    train_file, run_dir, gateway, _ = servers
    cfg = config_from_dict({
        "run_dir": str(tmp_path / "run"), "total_steps": 1, "progress": False, "device": "cpu",
        "model": {"path": str(run_dir / "initial")}, "data": {"train": [{"path": str(train_file)}]},
        # 3 generations of 40 and 2 observations of 72 (the gateway's) need 264 tokens; it was started with 96
        "rollout": {"gateway_url": gateway.url, "max_new_tokens": 40, "max_turns": 3},
    })
    with pytest.raises(ConfigError, match=r"max_response_tokens 96, below the 264 .* --max-response-tokens 264"):
        train(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
