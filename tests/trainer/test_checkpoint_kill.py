"""SIGKILL in the middle of a checkpoint save: the next start sweeps the temp directory, resumes from the
previous complete checkpoint, and ends with the same weights as a run that was never killed.

The trainer runs in a child process with `SISRL_TEST_CHECKPOINT_PAUSE` set (trainer/checkpoint.py,
`_test_pause`): once the save of step 2 has written model.safetensors it signals and waits, and the test kills
it there. Tolerance: exact (atol = rtol = 0), as in test_resume.py: one CPU thread in every process, and
everything that shapes the run comes back from checkpoint 1.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sisrl.trainer.checkpoint import MARKER, PAUSE_ENV, latest_checkpoint
from sisrl.trainer.loop import train

from tests.trainer.helpers import synthetic_config

CHILD = """\
import json, sys
import torch
from sisrl.trainer.config import config_from_dict
from sisrl.trainer.loop import train
torch.set_num_threads(1)
train(config_from_dict(json.loads(sys.argv[1])))
"""
SETTINGS = {"total_steps": 3, "checkpoint_every": 1, "rollout": {"prompts_per_step": 2},
            "algorithm": {"staleness": 2}}


def start_paused(run_dir: Path, point: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Start the trainer in a child process that stops when its save reaches `point`; returns it and the file it
    creates there."""
    cfg = synthetic_config(run_dir, **SETTINGS)
    paused = tmp_path / "paused"
    env = {**os.environ, PAUSE_ENV: f"{point}:{paused}"}
    with (tmp_path / "child.log").open("w") as log:
        child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg.model_dump(mode="json"))], env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
    return child, paused


def kill_when_paused(child: subprocess.Popen[bytes], paused: Path) -> None:
    try:
        deadline = time.monotonic() + 240
        while not paused.exists():
            log = paused.with_name("child.log")
            assert child.poll() is None, f"the trainer exited ({child.returncode}):\n{log.read_text()}"
            assert time.monotonic() < deadline, "the save never reached its pause point"
            time.sleep(0.1)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL


def checkpoint_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_000003"
    model, optimizer = load_file(str(ckpt / "model.safetensors")), load_file(str(ckpt / "optimizer.safetensors"))
    return {**{f"model.{k}": v for k, v in model.items()}, **{f"optimizer.{k}": v for k, v in optimizer.items()}}


def test_kill_during_save_resumes_from_the_previous_checkpoint_with_identical_weights(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.set_num_threads(1)
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    child, paused = start_paused(killed, "step_000002/model.safetensors", tmp_path)
    train(synthetic_config(whole, **SETTINGS))  # the uninterrupted run, while the child starts
    kill_when_paused(child, paused)
    ckpts = killed / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".step_000002.tmp", "step_000001"]
    assert (ckpts / ".step_000002.tmp" / "model.safetensors").is_file()
    assert not (ckpts / ".step_000002.tmp" / MARKER).exists()

    stale_policy = killed / "policy" / ".v000002.tmp-k2j3h4x9"  # a weight push killed the same way
    (stale_policy / "model.safetensors").parent.mkdir(parents=True)
    (stale_policy / "model.safetensors").write_bytes(b"half")

    with caplog.at_level(logging.INFO):
        train(synthetic_config(killed, **SETTINGS))
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "temp entries" in line] == [
        f"removed 2 temp entries that interrupted writes left: {ckpts / '.step_000002.tmp'}, {stale_policy}"]
    assert not stale_policy.exists()
    assert any(line.startswith(f"resumed from {ckpts / 'step_000001'} (step 1,") for line in lines), lines
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003"]

    a, b = checkpoint_tensors(whole), checkpoint_tensors(killed)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0.0, rtol=0.0, msg=name)
