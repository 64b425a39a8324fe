"""trainer/checkpoint.py: what "complete" means, the fallback past a torn checkpoint, and what is fsynced (also
for a policy push, trainer/policy.py).

A small Linear model with AdamW stands in for the policy: the files, the marker and the fallback do not depend on
the architecture (test_checkpoint_kill.py drives the real trainer).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.trainer.checkpoint import (
    MARKER,
    STATE_FILE,
    CheckpointError,
    check_complete,
    latest_checkpoint,
    read_latest,
    restore,
    save_checkpoint,
)
from sisrl.trainer.policy import save_hf_directory
from torch import nn

from tests.utils.fsync_spy import record_fsyncs


class Parts:
    """Model, AdamW, schedule and generator: everything `save_checkpoint` takes."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (step + 1))
        self.generator = torch.Generator().manual_seed(1)

    def train_step(self) -> None:
        self.model(torch.randn(2, 4)).square().sum().backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def save(self, run_dir: Path, step: int, keep: int = 3) -> Path:
        return save_checkpoint(run_dir, step=step, policy_version=step, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, generator=self.generator, sampler={"cursor": step},
                               config={"seed": 0}, keep=keep)

    def restore(self, run_dir: Path) -> int:
        ckpt = read_latest(run_dir)
        assert ckpt is not None
        return restore(ckpt, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                       generator=self.generator).step


def three_steps(run_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints 1, 2, 3 of three training steps; returns each step's weights."""
    parts, weights = Parts(), {}
    for step in (1, 2, 3):
        parts.train_step()
        parts.save(run_dir, step)
        weights[step] = {k: v.clone() for k, v in parts.model.state_dict().items()}
    return weights


def assert_weights(parts: Parts, expected: dict[str, torch.Tensor]) -> None:
    for name, value in parts.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0.0, rtol=0.0, msg=name)


def torn_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is torn" in r.getMessage()]


def test_complete_checkpoint_lists_every_file_with_its_size(tmp_path: Path) -> None:
    weights = three_steps(tmp_path)
    path = tmp_path / "checkpoints" / "step_000003"
    marker = json.loads((path / MARKER).read_text())
    on_disk = {p.name: p.stat().st_size for p in path.iterdir() if p.name != MARKER}
    assert marker["step"] == 3 and marker["files"] == on_disk
    assert set(on_disk) == {"model.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
                            "rng.rank0.safetensors", "rng.rank0.json", STATE_FILE}
    assert check_complete(path) is True and latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000001", "step_000002", "step_000003"]  # no temp directory left
    parts = Parts()
    assert parts.restore(tmp_path) == 3
    assert_weights(parts, weights[3])


@pytest.mark.parametrize("damage", ["marker missing", "file truncated", "file missing", "header garbled"])
def test_torn_latest_falls_back_to_the_previous_with_one_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    weights = three_steps(tmp_path)
    torn = tmp_path / "checkpoints" / "step_000003"
    model_file = torn / "model.safetensors"
    size = model_file.stat().st_size
    if damage == "marker missing":  # a copy (or an fsck) that lost the last file written
        (torn / MARKER).unlink()
        why = f"no {MARKER}"
    elif damage == "file truncated":
        os.truncate(model_file, size - 5)
        why = f"model.safetensors is {size - 5} bytes, {MARKER} says {size}"
    elif damage == "file missing":
        (torn / "optimizer.safetensors").unlink()
        why = "optimizer.safetensors is missing"
    else:  # the right size, unreadable: only opening the file can tell
        model_file.write_bytes(b"\xff" * size)
        why = "unreadable"
    parts = Parts()
    with caplog.at_level(logging.INFO, logger="sisrl.trainer.checkpoint"):
        assert parts.restore(tmp_path) == 2
    assert_weights(parts, weights[2])
    lines = torn_lines(caplog)
    assert len(lines) == 1 and str(torn) in lines[0] and why in lines[0], lines
    assert torn.is_dir()  # left as it is, for a person to look at


def test_a_checkpoint_torn_on_another_rank_is_skipped_by_every_rank(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    three_steps(tmp_path)
    votes: list[bool] = []

    def agree(ok: bool) -> bool:  # the newest checkpoint failed to read on another rank
        votes.append(ok)
        return ok and len(votes) > 1

    with caplog.at_level(logging.INFO, logger="sisrl.trainer.checkpoint"):
        ckpt = read_latest(tmp_path, agree=agree)
    assert ckpt is not None and ckpt.path.name == "step_000002" and votes == [True, True]
    assert "another rank" in torn_lines(caplog)[0]


def test_checkpoint_without_marker_from_an_older_sisrl_is_accepted_with_a_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    weights = three_steps(tmp_path)
    old = tmp_path / "checkpoints" / "step_000003"
    (old / MARKER).unlink()
    state = json.loads((old / STATE_FILE).read_text())
    del state["format"]  # what a sisrl before COMPLETE markers wrote
    (old / STATE_FILE).write_text(json.dumps(state))
    parts = Parts()
    with caplog.at_level(logging.INFO, logger="sisrl.trainer.checkpoint"):
        assert parts.restore(tmp_path) == 3
    assert_weights(parts, weights[3])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "older sisrl" in lines[0] and str(old) in lines[0], lines
    (old / STATE_FILE).unlink()  # without trainer_state.json either: a save that never finished
    with pytest.raises(CheckpointError, match="no COMPLETE and no trainer_state.json"):
        check_complete(old)


def test_no_readable_checkpoint_refuses_to_start_over(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None  # a fresh run
    three_steps(tmp_path)
    for path in (tmp_path / "checkpoints").iterdir():
        (path / MARKER).unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint.*step_000003.*step_000002.*step_000001"):
        read_latest(tmp_path)


def test_rotation_keeps_the_newest_complete_checkpoints_past_a_torn_one(tmp_path: Path) -> None:
    parts = Parts()
    for step in (1, 2, 3):
        parts.save(tmp_path, step, keep=2)
    (tmp_path / "checkpoints" / "step_000003" / MARKER).unlink()  # torn: the run resumes from 2 ...
    parts.save(tmp_path, 3, keep=2)  # ... and saves 3 again over it
    parts.save(tmp_path, 4, keep=2)
    (tmp_path / "checkpoints" / "step_000004" / MARKER).unlink()
    parts.save(tmp_path, 2, keep=2)  # an older step saved after a torn newer one: 4 stays, uncounted
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000002", "step_000003", "step_000004"]


def test_save_fsyncs_every_file_then_the_marker_then_the_renames(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    parts = Parts()
    parts.train_step()
    calls = record_fsyncs(monkeypatch)
    final = parts.save(tmp_path, 1)
    tmp, root = tmp_path / "checkpoints" / ".step_000001.tmp", tmp_path / "checkpoints"
    files = [str(tmp / name) for name in json.loads((final / MARKER).read_text())["files"]]
    assert sorted(calls[:-4]) == sorted(files) and len(files) == 7  # each file once, in the temp directory
    # then the marker, the names in the temp directory, its rename, and `checkpoints/` (new in this run)
    assert calls[-4:] == [str(tmp / MARKER), str(tmp), str(root), str(tmp_path)]


def test_policy_push_fsyncs_every_file_and_its_folder_before_the_rename(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = load_tokenizer()
    model = build_tiny_policy(tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    calls = record_fsyncs(monkeypatch)
    out = save_hf_directory(model, tokenizer, tmp_path / "policy" / "v000001")
    tmp = Path(calls[-2])
    assert tmp.parent == out.parent and tmp.name.startswith(".v000001.tmp-") and calls[-1] == str(out.parent)
    assert sorted(Path(c).relative_to(tmp).as_posix() for c in calls[:-2]) == sorted(
        p.name for p in out.iterdir())  # every file the engine will load, once
    assert {"model.safetensors", "config.json"} <= {p.name for p in out.iterdir()}
    assert [p.name for p in out.parent.iterdir()] == ["v000001"]
