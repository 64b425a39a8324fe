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
