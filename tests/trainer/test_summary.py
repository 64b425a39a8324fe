"""`runs/demo/summary.json`: its fixed schema (`trainer/summary.py`), its table and its plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sisrl.trainer.summary import (
    DemoSummary,
    plot_summary,
    read_summary,
    stage_eval,
    summary_table,
    write_summary,
)


def _stage(em: float, nq: float, hotpot: float, searches: float) -> dict[str, float]:
    """What trainer.evaluate.evaluate returns for one stage."""
    return {"eval/em": em, "eval/em/nq": nq, "eval/em/hotpotqa": hotpot, "eval/f1/nq": nq, "eval/count/nq": 10.0,
            "eval/searches_per_traj": searches}


def _summary() -> DemoSummary:
    return DemoSummary(eval={"before": stage_eval(_stage(0.0, 0.0, 0.0, 0.0)),
                             "after_sft": stage_eval(_stage(0.5, 0.7, 0.1, 1.2)),
                             "after_rl": stage_eval(_stage(0.75, 0.9, 0.45, 1.4))},
                       train_reward=[0.1, 0.2, 0.6], steps=3, checkpoint="runs/demo/run/checkpoints/step_000003",
                       wall_s=812.0, sft_steps=4)


def test_summary_file_has_exactly_the_issue_keys(tmp_path: Path) -> None:
    path = write_summary(tmp_path / "summary.json", _summary())
    raw = json.loads(path.read_text())
    assert {"eval", "train_reward", "steps", "checkpoint", "wall_s"} <= set(raw)
    assert set(raw["eval"]) == {"before", "after_sft", "after_rl"}
    assert raw["eval"]["after_rl"] == {"em": 0.75, "em_by_source": {"hotpotqa": 0.45, "nq": 0.9},
                                       "searches_per_traj": 1.4}
    assert raw["train_reward"] == [0.1, 0.2, 0.6] and raw["steps"] == 3 and raw["sft_steps"] == 4
    assert read_summary(path).eval["after_sft"].em == 0.5


def test_a_summary_without_a_stage_or_with_a_bad_em_is_refused(tmp_path: Path) -> None:
    raw = json.loads(write_summary(tmp_path / "s.json", _summary()).read_text())
    del raw["eval"]["after_sft"]
    (tmp_path / "missing.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"(?s)missing.json: not a demo summary .*after_sft"):
        read_summary(tmp_path / "missing.json")
    raw = json.loads((tmp_path / "s.json").read_text())
    raw["eval"]["before"]["em"] = 1.5
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="bad.json"):
        read_summary(tmp_path / "bad.json")


def test_table_and_plot(tmp_path: Path) -> None:
    table = summary_table(_summary()).splitlines()
    assert table[0].split() == ["stage", "EM", "EM", "hotpotqa", "EM", "nq", "searches"]
    assert table[3].split() == ["after_rl", "0.750", "0.450", "0.900", "1.40"]
    assert "0.10 0.20 0.60" in table[4]
    assert not any(line.startswith("CPU:") for line in table)  # a summary without the machine's keys
    machine = _summary().model_copy(update={"cpu": "AMD EPYC (family 25 model 17; AVX-512, native bf16: avx512_bf16)",
                                            "engine_dtype": "bfloat16", "trainer_dtype": "float32"})
    assert summary_table(machine).splitlines()[-1] == ("CPU: AMD EPYC (family 25 model 17; AVX-512, native bf16: "
                                                       "avx512_bf16); rollout engine bfloat16, trainer float32")
    png = plot_summary(_summary(), tmp_path / "plots" / "reward_em.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
