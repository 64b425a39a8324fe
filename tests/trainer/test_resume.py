"""2 steps, stop, resume, 2 more steps gives the same parameters as 4 uninterrupted steps.

Tolerance: exact (atol = rtol = 0). Everything that shapes the run is restored from the checkpoint (weights,
AdamW moments, LR schedule, the update RNG, torch/python RNG, step and policy version), and the synthetic
rollouts are seeded by (seed, step), so on one CPU thread the two runs do the same float operations.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from sisrl.trainer.checkpoint import latest_checkpoint
from sisrl.trainer.cli import main as cli_main
from sisrl.trainer.loop import train
from sisrl.trainer.metrics import read_metrics

from tests.trainer.helpers import synthetic_config


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    return load_file(str(ckpt / "model.safetensors"))


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    settings = {"total_steps": 4, "checkpoint_every": 1, "optim": {"schedule": "cosine", "warmup_steps": 2}}
    whole = tmp_path / "whole"
    train(synthetic_config(whole, **settings))

    split = tmp_path / "split"
    first = train(synthetic_config(split, **settings), stop_after=2)
    assert len(first) == 2
    torch.manual_seed(12345)  # scramble the global RNG: only the checkpoint may restore it
    second = train(synthetic_config(split, **settings))
    assert len(second) == 2

    state = json.loads((latest_checkpoint(split) / "trainer_state.json").read_text())  # type: ignore[operator]
    assert (state["step"], state["policy_version"]) == (4, 4)
    a, b = _final_weights(whole), _final_weights(split)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0.0, rtol=0.0, msg=name)
    rows = read_metrics(split)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in read_metrics(whole)]
    steps_dirs = sorted(p.name for p in (split / "checkpoints").iterdir())
    assert steps_dirs == ["step_000003", "step_000004"]  # keep_checkpoints = 2, no temp dirs left
    assert all(r["actor/grad_norm"] > 0 and r["guard/skipped_updates"] == 0 for r in rows)  # real updates
    assert cli_main(["plot", str(split)]) == 0
    assert {"reward.png", "sis.png", "actor.png", "time.png"} <= {p.name for p in (split / "plots").iterdir()}
