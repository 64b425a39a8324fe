"""The wire constants of sisrl.common.wire are what each part's defaults and limits actually say."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from sisrl.common import wire
from sisrl.retriever.settings import Settings as RetrieverSettings
from sisrl.services.engines.base import MIN_LOGPROB, SamplingParams
from sisrl.services.schemas import SamplingIn
from sisrl.services.schemas import Trajectory as GatewayTrajectory
from sisrl.services.settings import GatewaySettings
from sisrl.trainer.batch import Trajectory as TrainerTrajectory
from sisrl.trainer.config import RolloutConfig, TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "trainer" / "configs"


def test_trajectory_fields_are_the_gateway_model_and_a_superset_of_the_trainers() -> None:
    assert tuple(GatewayTrajectory.model_fields) == wire.TRAJECTORY_FIELDS
    assert {f.name for f in fields(TrainerTrajectory)} <= set(wire.TRAJECTORY_FIELDS)


def test_logprob_floor_and_k_limits() -> None:
    assert MIN_LOGPROB == wire.MIN_LOGPROB
    assert SamplingParams().logprobs_k == SamplingIn().logprobs_k == wire.DEFAULT_LOGPROBS_K
    SamplingIn(logprobs_k=wire.MAX_LOGPROBS_K)
    with pytest.raises(ValueError, match="less than or equal to 100"):
        SamplingIn(logprobs_k=wire.MAX_LOGPROBS_K + 1)


def test_gateway_and_retriever_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SISRL_GATEWAY_PORT", "SISRL_GATEWAY_RETRIEVER_URL", "SISRL_RETRIEVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    settings = GatewaySettings()
    assert settings.port == wire.GATEWAY_PORT
    assert settings.retriever_url == wire.RETRIEVER_URL
    assert RetrieverSettings(index=Path(".")).port == wire.RETRIEVER_PORT


def test_the_trainers_pushed_weights_lie_under_the_gateways_checkpoint_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SISRL_GATEWAY_CHECKPOINT_ROOT", raising=False)
    root = GatewaySettings().checkpoint_root.resolve()
    pushed = Path(TrainConfig.model_fields["run_dir"].default).resolve() / "policy" / "v1"  # loop._push_weights
    assert pushed.is_relative_to(root)


def test_trainer_talks_to_the_gateways_default_port() -> None:
    assert RolloutConfig.model_fields["gateway_url"].default == wire.GATEWAY_URL
    for path in sorted(CONFIGS.glob("*.yaml")):
        url = (yaml.safe_load(path.read_text()).get("rollout") or {}).get("gateway_url", wire.GATEWAY_URL)
        assert url.rstrip("/").rsplit(":", 1)[-1] == str(wire.GATEWAY_PORT), path.name
