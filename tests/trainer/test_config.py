"""Config validation: unknown keys and bad values fail naming the dotted key; shipped configs load."""

from __future__ import annotations

from pathlib import Path

import pytest
from sisrl.trainer.cli import main as cli_main
from sisrl.trainer.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    describe_fields,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "trainer" / "configs"


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.stalenes: unknown key"):
        config_from_dict({"algorithm": {"stalenes": 4}, "rollout": {"source": "synthetic"}})


def test_bad_value_is_named_with_the_value() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.ratio: .*'none', 'is', 'sis', 'tis', 'icepop' or 'seqmask'.*\(got 'foo'\)"):
        config_from_dict({"algorithm": {"ratio": "foo"}, "rollout": {"source": "synthetic"}})
    with pytest.raises(ConfigError, match=r"optim\.lr: Input should be greater than 0 \(got -1\)"):
        config_from_dict({"optim": {"lr": -1}, "rollout": {"source": "synthetic"}})


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.staleness=64 exceeds the rollout batch"):
        config_from_dict({"algorithm": {"staleness": 64}, "rollout": {"source": "synthetic"}})
    with pytest.raises(ConfigError, match=r"data\.train must list at least one file"):
        config_from_dict({})
    with pytest.raises(ConfigError, match=r"dynamic_sampling needs rollout\.samples_per_prompt >= 2"):
        config_from_dict({"algorithm": {"dynamic_sampling": True, "staleness": 1},
                          "rollout": {"source": "synthetic", "samples_per_prompt": 1}})
    with pytest.raises(ConfigError, match=r"sis_exact=true needs algorithm\.ratio=sis .*behaviour=recompute \(got 'rollout'\)"):
        config_from_dict({"algorithm": {"sis_exact": True}, "rollout": {"source": "synthetic"}})


def test_overrides_are_typed_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  source: synthetic\n")
    cfg = load_config(path, ["algorithm.staleness=8", "optim.lr=1e-5", "algorithm.dynamic_sampling=true"])
    assert (cfg.algorithm.staleness, cfg.optim.lr, cfg.algorithm.dynamic_sampling) == (8, 1e-5, True)
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["algorithm.staleness"])
    with pytest.raises(ConfigError, match=r"algorithm\.staleness: Input should be a valid integer"):
        load_config(path, ["algorithm.staleness=many"])


def test_contract_rules_are_checked_at_load() -> None:
    train = {"data": {"train": [{"path": "t.jsonl"}]}}
    with pytest.raises(ConfigError, match=r"rollout\.top_p=0\.9: gateway rollouts need top_p 1\.0"):
        config_from_dict({**train, "rollout": {"top_p": 0.9}})
    assert config_from_dict({"rollout": {"source": "synthetic", "top_p": 0.9}}).rollout.top_p == 0.9
    with pytest.raises(ConfigError, match=r"algorithm\.logprobs_k: Input should be less than or equal to 100"):
        config_from_dict({**train, "algorithm": {"logprobs_k": 101}})
    from sisrl.common.wire import GATEWAY_URL

    assert config_from_dict(train).rollout.gateway_url == GATEWAY_URL == "http://127.0.0.1:8100"


RENAMED_TOPK = ("algorithm.topk was renamed algorithm.logprobs_k (K of the behaviour top-K; "
                "the gateway's topk is passages per search)")


def test_the_old_topk_key_names_its_new_name(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  source: synthetic\nalgorithm:\n  topk: 8\n")
    with pytest.raises(ConfigError) as from_yaml:
        load_config(path)
    with pytest.raises(ConfigError) as from_override:
        load_config(None, ["rollout.source=synthetic", "algorithm.topk=8"])
    for err in (from_yaml, from_override):
        assert RENAMED_TOPK in str(err.value) and "unknown key" not in str(err.value)
    path.write_text(path.read_text().replace("topk", "logprobs_k"))
    assert load_config(path).algorithm.logprobs_k == 8
    # only the trainer's old key is special: a topk in another section is just unknown
    with pytest.raises(ConfigError, match=r"rollout\.topk: unknown key"):
        load_config(path, ["rollout.topk=3"])


def test_cli_names_the_renamed_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["train", "--set", "rollout.source=synthetic", "--set", "algorithm.topk=8"]) == 2
    assert RENAMED_TOPK in capsys.readouterr().err


def test_the_api_token_is_never_written_out() -> None:
    cfg = config_from_dict({"data": {"train": [{"path": "t.jsonl"}]}, "rollout": {"api_token": "s3cret-token"}})
    assert cfg.rollout.api_token is not None and cfg.rollout.api_token.get_secret_value() == "s3cret-token"
    assert "s3cret-token" not in cfg.model_dump_json() and "s3cret-token" not in str(cfg.model_dump(mode="json"))


def test_config_is_frozen() -> None:
    cfg = config_from_dict({"rollout": {"source": "synthetic"}})
    with pytest.raises(ValueError, match="frozen"):
        cfg.algorithm.staleness = 2  # type: ignore[misc]


def test_every_field_is_described() -> None:
    rows = describe_fields()
    assert len(rows) > 60
    assert all(desc for _, _, desc in rows), [key for key, _, desc in rows if not desc]


@pytest.mark.parametrize("name", ["demo_cpu", "nq_hotpotqa_qwen3b_gpu", "staleness"])
def test_shipped_configs_load(name: str) -> None:
    path = CONFIGS / f"{name}.yaml"
    assert path.read_text().startswith("# "), "a config starts with its command and hardware"
    assert isinstance(load_config(path), TrainConfig)


def test_cli_reports_a_bad_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["train", "--set", "rollout.source=synthetic", "--set", "algorithm.stalenes=3"]) == 2
    assert "algorithm.stalenes: unknown key" in capsys.readouterr().err


def test_the_gateway_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SISRL_GATEWAY_API_TOKEN", "t" * 20)
    cfg = load_config(None, ["data.train=[{path: x.jsonl}]"])
    assert cfg.rollout.api_token is not None and cfg.rollout.api_token.get_secret_value() == "t" * 20
    assert "t" * 20 not in cfg.model_dump_json()  # never written out
    with caplog.at_level("WARNING", logger="sisrl.trainer.config"):
        cfg = load_config(None, ["data.train=[{path: x.jsonl}]", f"rollout.api_token={'u' * 20}"])
    assert cfg.rollout.api_token is not None and cfg.rollout.api_token.get_secret_value() == "u" * 20  # given wins
    assert "process list" in caplog.text and "SISRL_GATEWAY_API_TOKEN" in caplog.text
