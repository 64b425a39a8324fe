"""The rollout protocol keys of the trainer config: validated at start, the Search-R1 profile, and the request the
trainer sends (checked against the gateway's own request schema and protocol defaults)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sisrl.services.protocol import ProtocolSpec
from sisrl.services.runner import protocol_spec
from sisrl.services.schemas import RolloutCreate
from sisrl.trainer.cli import main as cli_main
from sisrl.trainer.config import SEARCH_R1, ConfigError, RolloutConfig, config_from_dict, load_config
from sisrl.trainer.data import QAItem
from sisrl.trainer.gateway_client import GatewayClient

TRAIN = "data.train=[{path: nq.jsonl}]"
ITEMS = [QAItem(id="q1", question="who wrote the iliad", golden_answers=("Homer",), data_source="nq")]


def _body(cfg: RolloutConfig) -> RolloutCreate:
    body = GatewayClient.rollout_body(run="r", step=3, policy_version=3, items=ITEMS, cfg=cfg, k=5, seed=0)
    return RolloutCreate.model_validate(body)


def test_a_template_without_question_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.prompt_template: .*has no \{question\}.*\(got 'Answer it now'\)"):
        load_config(None, [TRAIN, "rollout.prompt_template=Answer it now"])
    no_slot = tmp_path / "prompt.txt"
    no_slot.write_text("Answer the question.\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"rollout\.prompt_template_file: .*{no_slot} has no \{{question\}}"):
        load_config(None, [TRAIN, f"rollout.prompt_template_file={no_slot}"])
    with pytest.raises(ConfigError, match=r"rollout\.observation_template: .*holds \{passages\} 0 times"):
        load_config(None, [TRAIN, "rollout.observation_template=<information></information>"])
    # The CLI stops on it before any rollout or model: exit 2, the key and the value on one line.
    assert cli_main(["train", "--set", "rollout.source=synthetic", "--set", "rollout.prompt_template=Go"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "rollout.prompt_template" in line] == [
        "  rollout.prompt_template: Value error, has no {question}: the template must say where the question goes "
        "(got 'Go')"]


def test_the_default_request_is_the_gateway_protocol() -> None:
    """Nothing set: the request's protocol resolves to the gateway's own defaults (its behaviour before these
    settings existed)."""
    body = _body(load_config(None, [TRAIN]).rollout)
    assert protocol_spec(body.protocol) == ProtocolSpec()


def test_settings_and_the_template_file_reach_the_request(tmp_path: Path) -> None:
    template = tmp_path / "prompt.txt"
    template.write_text("Use <search> and <answer>.\nQuestion: {question}\n", encoding="utf-8")
    cfg = config_from_dict({"data": {"train": [{"path": "nq.jsonl"}]}, "rollout": {
        "prompt_template_file": str(template), "apply_chat_template": False,
        "passage_template": "[{i}] {title}: {text}\n", "observation_max_tokens": 300}})
    spec = protocol_spec(_body(cfg.rollout).protocol)
    assert spec == ProtocolSpec(prompt_template=template.read_text(encoding="utf-8"), apply_chat_template=False,
                                passage_template="[{i}] {title}: {text}\n", observation_max_tokens=300)
    with pytest.raises(ConfigError, match="set rollout.prompt_template or rollout.prompt_template_file, not both"):
        load_config(None, [TRAIN, f"rollout.prompt_template_file={template}", "rollout.prompt_template='Q: {question}'"])


def test_the_search_r1_profile(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.protocol=search-r1 needs Search-R1's prompt"):
        load_config(None, [TRAIN, "rollout.protocol=search-r1"])
    template = tmp_path / "search_r1_prompt.txt"
    template.write_text("Instructions in their words. Question: {question}\n", encoding="utf-8")
    cfg = load_config(None, [TRAIN, "rollout.protocol=search-r1", f"rollout.prompt_template_file={template}"])
    spec = protocol_spec(_body(cfg.rollout).protocol)
    assert spec == ProtocolSpec(prompt_template=template.read_text(encoding="utf-8"), append_question_mark=True,
                                apply_chat_template="auto", strip_passages=True, observation_truncation="whole",
                                observation_max_tokens=500)
    assert {key: getattr(cfg.rollout, key) for key in SEARCH_R1} == SEARCH_R1
    # A key the config sets wins over the profile.
    mine = load_config(None, [TRAIN, "rollout.protocol=search-r1", f"rollout.prompt_template_file={template}",
                              "rollout.apply_chat_template=false"])
    assert mine.rollout.apply_chat_template is False and mine.rollout.strip_passages is True


def test_eval_sends_the_runs_prompt_format(tmp_path: Path) -> None:
    """`sisrl-train eval` of a checkpoint evaluates with the prompt and observation format the run trained on."""
    from sisrl.trainer.evaluate import eval_settings

    template = tmp_path / "prompt.txt"
    template.write_text("Answer it, searching first. Question: {question}\n")
    cfg = config_from_dict({"rollout": {"protocol": "search-r1", "prompt_template_file": str(template)},
                            "data": {"train": [{"path": str(template)}]}})
    run_dir = tmp_path / "run"
    (run_dir / "policy" / "v000003").mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    settings = eval_settings(run_dir / "policy" / "v000003", {})
    sent = settings.rollout("http://127.0.0.1:1")
    assert sent.prompt_template_file == str(template) and sent.observation_truncation == "whole"
    assert sent.append_question_mark and sent.apply_chat_template == "auto" and sent.observation_max_tokens == 500
    assert "the run's prompt and observation format" in settings.describe()
    plain = eval_settings(tmp_path / "elsewhere", {})  # no run: the gateway's own format
    assert plain.protocol == {} and plain.rollout("http://127.0.0.1:1").prompt_template_file is None
