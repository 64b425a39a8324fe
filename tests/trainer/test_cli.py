"""`sisrl-train` as a user meets it: what it says when the rollout gateway is not there."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sisrl.common.procs import free_port
from sisrl.trainer.cli import main


def test_train_without_a_gateway_is_one_line_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"id": "q1", "question": "who?", "golden_answers": ["x"]}\n')
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    code = main(["train", "--set", f"run_dir={tmp_path / 'run'}", "--set", f"rollout.gateway_url={url}",
                 "--set", f"data.train=[{{path: {questions}}}]", "--set", "progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err, err
    assert err.startswith(f"sisrl-train train: no rollout gateway answers at {url} (")
    assert err.endswith("or set rollout.gateway_url to its URL")
    assert not (tmp_path / "run" / "config.json").exists()  # stopped in setup, before any model or file
    assert time.monotonic() - started < 30


def _eval_args(checkpoint: Path, *flags: str):  # noqa: ANN202
    from sisrl.trainer.cli import build_parser

    return build_parser().parse_args(["eval", "--checkpoint", str(checkpoint), "--data", "q.jsonl", *flags])


def test_eval_defaults_follow_the_run_that_wrote_the_checkpoint(tmp_path: Path) -> None:
    """A policy trained with 3 generations per trajectory, evaluated with the bare default of 2, searches twice
    and never answers: eval takes the run's limits and K unless a flag says otherwise, and decodes greedily."""
    import json

    from sisrl.trainer.cli import eval_settings
    from sisrl.trainer.config import RolloutConfig

    run = {"rollout": {"max_turns": 3, "max_new_tokens": 96}, "algorithm": {"logprobs_k": 7}}
    step = tmp_path / "run" / "checkpoints" / "step_000008"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 8, "config": run}))
    rollout, k = eval_settings(_eval_args(step))
    assert (rollout.max_turns, rollout.max_new_tokens, k) == (3, 96, 7)
    rollout, k = eval_settings(_eval_args(step, "--max-turns", "5", "--logprobs-k", "4"))
    assert (rollout.max_turns, rollout.max_new_tokens, k) == (5, 96, 4)  # a flag given wins
    assert _eval_args(step).temperature == 0.0  # greedy

    # The SFT warm start's HF directory: RUN_DIR/hf, whose own config.json is the model's, not the run's.
    hf = tmp_path / "sft" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf.parent / "config.json").write_text(json.dumps({"rollout": {"max_turns": 4}}))
    assert eval_settings(_eval_args(hf))[0].max_turns == 4

    bare = tmp_path / "models" / "policy"  # no sisrl run wrote it: the defaults
    bare.mkdir(parents=True)
    (bare.parent / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rollout, k = eval_settings(_eval_args(bare))
    assert (rollout.max_turns, rollout.max_new_tokens) == (RolloutConfig().max_turns, RolloutConfig().max_new_tokens)
