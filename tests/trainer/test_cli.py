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
    and never answers: eval takes every per-request setting of the run (turns, tokens per turn, top-p, K, seed)
    unless a flag says otherwise, decodes greedily as the trainer's own eval does, and says where each came from."""
    import json

    from sisrl.trainer.cli import eval_settings
    from sisrl.trainer.config import RolloutConfig

    run = {"seed": 11, "rollout": {"max_turns": 3, "max_new_tokens": 96, "top_p": 1.0, "temperature": 0.7},
           "algorithm": {"logprobs_k": 7}}
    step = tmp_path / "run" / "checkpoints" / "step_000008"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 8, "config": run}))
    got = eval_settings(_eval_args(step))
    assert got.values == {"max_turns": 3, "max_new_tokens": 96, "top_p": 1.0, "logprobs_k": 7, "seed": 11,
                          "temperature": 0.0}  # greedy, not the run's sampling temperature 0.7
    assert set(got.sources.values()) == {"run", "default: greedy, as the trainer's eval"}
    assert got.run_dir == tmp_path / "run" and got.run_file == step / "trainer_state.json"
    rollout = got.rollout("http://127.0.0.1:9")
    assert (rollout.max_turns, rollout.max_new_tokens, rollout.gateway_url) == (3, 96, "http://127.0.0.1:9")
    got = eval_settings(_eval_args(step, "--max-turns", "5", "--logprobs-k", "4", "--seed", "2", "--temperature", "1"))
    assert got.values == {"max_turns": 5, "max_new_tokens": 96, "top_p": 1.0, "logprobs_k": 4, "seed": 2,
                          "temperature": 1.0}  # a flag given wins
    assert got.describe() == (f"eval: max_turns=5 (flag) max_new_tokens=96 (run) top_p=1.0 (run) logprobs_k=4 (flag) "
                              f"seed=2 (flag) temperature=1.0 (flag) samples_per_item=1; unset flags from the run's "
                              f"config {step / 'trainer_state.json'}; the default prompt format")

    # The SFT warm start's HF directory: RUN_DIR/hf, whose own config.json is the model's, not the run's.
    hf = tmp_path / "sft" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf.parent / "config.json").write_text(json.dumps({"rollout": {"max_turns": 4}}))
    got = eval_settings(_eval_args(hf))
    assert got.values["max_turns"] == 4 and got.sources["max_new_tokens"] == "default"
    assert got.run_dir == tmp_path / "sft"

    bare = tmp_path / "models" / "policy"  # no sisrl run wrote it: the defaults
    bare.mkdir(parents=True)
    (bare.parent / "config.json").write_text(json.dumps({"model_type": "llama"}))
    got = eval_settings(_eval_args(bare))
    assert (got.values["max_turns"], got.values["max_new_tokens"], got.values["seed"]) == (
        RolloutConfig().max_turns, RolloutConfig().max_new_tokens, 0)
    assert got.run_dir is None and got.describe().endswith("no run config found: the defaults; the default prompt format")


def test_eval_names_gateway_settings_that_differ_from_the_run(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Passages per search and the budgets are set when a gateway starts, never per request: the run records its
    gateway's (RUN_DIR/gateway.json), and eval names each one its gateway sets otherwise."""
    import json

    from sisrl.services.cli import build_parser as gateway_parser
    from sisrl.trainer.evaluate import (
        GATEWAY_FILE,
        gateway_flags,
        gateway_note,
        record_gateway,
        recorded_gateway,
    )

    trained = {"topk": 3, "observation_max_tokens": 512, "max_response_tokens": 2048, "format_weight": 0.0}
    assert gateway_note(tmp_path, trained).endswith("the run recorded none to compare")
    assert recorded_gateway(tmp_path) is None and recorded_gateway(None) is None
    record_gateway(tmp_path, trained)
    assert json.loads((tmp_path / GATEWAY_FILE).read_text()) == trained
    # crossworld starts its gateway with the recorded settings: each key is a `sisrl-gateway serve` flag
    assert recorded_gateway(tmp_path) == trained
    serve = gateway_parser().parse_args(["serve", *gateway_flags(trained)])
    assert {key: getattr(serve, key) for key in trained} == trained
    assert gateway_note(tmp_path, trained) == ("gateway (set at its start, not per request): topk=3 "
                                               "observation_max_tokens=512 max_response_tokens=2048 "
                                               "format_weight=0.0, as in the run")
    here = {**trained, "topk": 5}
    note = gateway_note(tmp_path, here)
    assert "NOT as in the run: topk 5 (run: 3) (restart the gateway" in note, note
    assert gateway_note(None, None).startswith("the gateway reports no rollout settings")

    with caplog.at_level("WARNING", logger="sisrl.trainer.evaluate"):
        record_gateway(tmp_path, here)  # a resumed run on a gateway started otherwise
    assert "changed since this run last started: topk 5 (run: 3)" in caplog.text
    assert json.loads((tmp_path / GATEWAY_FILE).read_text())["topk"] == 5
