"""Evaluation through the gateway: EM / F1 per data source of one policy on question files.

`sisrl-train eval --checkpoint PATH --data FILE` pushes the checkpoint's weights to the gateway (a trainer
checkpoint is first exported as a Hugging Face directory), rolls out every question once, greedily (temperature
0), and reports the mean EM and F1 per data source. Every per-request setting the run's own evaluation sends
(turn limits, tokens per turn, top-p, K, seed) defaults to that of the run that wrote the checkpoint
(`run_config`), so a checkpoint is evaluated under the protocol it was trained with. The settings that only a
gateway's start sets (passages per search, observation and response budgets, format weight) the run records in
RUN_DIR/gateway.json (`record_gateway`), and `gateway_note` names those the evaluating gateway sets otherwise.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from sisrl.common.atomic import write_json
from sisrl.trainer.batch import Trajectory
from sisrl.trainer.checkpoint import STATE_FILE
from sisrl.trainer.config import AlgorithmConfig, ModelConfig, RolloutConfig, TrainConfig, lookup
from sisrl.trainer.data import QAItem
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.policy import load_policy, save_hf_directory

log = logging.getLogger(__name__)
GATEWAY_FILE = "gateway.json"  # RUN_DIR/gateway.json: the gateway's /health `rollout` settings the run used
# The per-request rollout settings eval follows: name (= its flag) -> key in the run's config. The trainer's own
# evaluation (`_evaluate` in loop.py) sends these from the run's config, one sample per question, greedily.
FOLLOWED = {"max_turns": "rollout.max_turns", "max_new_tokens": "rollout.max_new_tokens",
            "top_p": "rollout.top_p", "logprobs_k": "algorithm.logprobs_k", "seed": "seed"}
# The prompt and observation format (`rollout.protocol` and the keys it fills): always the run's, no flags; a
# policy is evaluated on the prompts it was trained on.
PROTOCOL_KEYS = ("protocol", "prompt_template", "prompt_template_file", "append_question_mark", "apply_chat_template",
                 "observation_template", "passage_template", "strip_passages", "observation_truncation",
                 "observation_max_tokens", "invalid_action_message")


def export_hf(checkpoint: Path) -> Path:
    """A directory the gateway can load: an HF directory as is, or a trainer checkpoint exported to CKPT/hf."""
    if (checkpoint / "config.json").is_file():
        return checkpoint
    state_path = checkpoint / STATE_FILE
    if not state_path.is_file():
        raise ValueError(f"{checkpoint} is neither a Hugging Face directory nor a trainer checkpoint")
    meta = json.loads(state_path.read_text())
    if meta["sharded"]:
        raise ValueError(f"{checkpoint} is an FSDP2 sharded checkpoint; use the HF directory pushed at that step "
                         "(RUN_DIR/policy/vNNNNNN)")
    out = checkpoint / "hf"
    if (out / "config.json").is_file():
        return out
    model_cfg = ModelConfig.model_validate(meta["config"]["model"])
    model, tokenizer = load_policy(model_cfg, seed=int(meta["config"]["seed"]), device=torch.device("cpu"))
    weights = load_file(str(checkpoint / "model.safetensors"))
    model.load_state_dict(weights, strict=False)  # tied lm_head is saved once, under the embedding's name
    return save_hf_directory(model, tokenizer, out)


def run_config(checkpoint: Path) -> tuple[dict[str, Any], Path] | None:
    """The config of the run that wrote `checkpoint`, and the file it was read from; None for a directory that
    no `sisrl-train` run wrote. A trainer checkpoint carries it (trainer_state.json); an exported or warm-started
    HF directory (RUN_DIR/hf, RUN_DIR/policy/vN) finds it in RUN_DIR/config.json."""
    state = checkpoint / STATE_FILE
    if state.is_file():
        return json.loads(state.read_text())["config"], state
    for run_dir in (checkpoint.parent, checkpoint.parent.parent):
        path = run_dir / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(cfg, dict) and isinstance(cfg.get("rollout"), dict):  # not a model's config.json
            return cfg, path
    return None


@dataclass(frozen=True)
class EvalSettings:
    """What `sisrl-train eval` sends with its batch, and where each value came from."""

    values: dict[str, Any]  # every FOLLOWED name, and temperature
    sources: dict[str, str]  # the same names -> "flag", "run" or "default"
    run_file: Path | None  # the run config followed; None when no sisrl-train run wrote the checkpoint
    run_dir: Path | None  # the run's directory (where GATEWAY_FILE lies)
    protocol: dict[str, Any] = field(default_factory=dict)  # the run's PROTOCOL_KEYS it sets (empty: the defaults)
    defaults_name: str = "the defaults"  # what stands in for a value no flag and no run config gives

    def rollout(self, gateway_url: str) -> RolloutConfig:
        """The rollout section `evaluate` sends (it sets one sample per question and the temperature)."""
        v = self.values
        return RolloutConfig(gateway_url=gateway_url, max_turns=v["max_turns"], max_new_tokens=v["max_new_tokens"],
                             top_p=v["top_p"], **self.protocol)

    def describe(self) -> str:
        """One line: each value and its source (`max_turns=3 (run) ... seed=2 (flag) ...`) and the run's file."""
        shown = " ".join(f"{name}={value} ({self.sources[name]})" for name, value in self.values.items())
        origin = f"the run's config {self.run_file}" if self.run_file else f"no run config found: {self.defaults_name}"
        fmt = "the run's prompt and observation format" if self.protocol else "the default prompt format"
        return f"eval: {shown} samples_per_item=1; unset flags from {origin}; {fmt}"


def eval_settings(checkpoint: Path | None, flags: dict[str, Any], *, defaults: dict[str, Any] | None = None,
                  defaults_name: str = "the defaults") -> EvalSettings:
    """Each FOLLOWED setting from its flag when given (not None), else from the run that wrote `checkpoint` (None:
    no checkpoint, no run), else from `defaults` (a dumped TrainConfig, e.g. the demo's; None: TrainConfig's own
    defaults, named `defaults_name` in `describe`); temperature from its flag, else 0 (greedy, as the trainer's
    own evaluation)."""
    found = run_config(checkpoint) if checkpoint is not None else None
    run = found[0] if found else {}
    if defaults is None:
        defaults = {"rollout": RolloutConfig().model_dump(), "algorithm": AlgorithmConfig().model_dump(),
                    "seed": TrainConfig.model_fields["seed"].default}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, key in FOLLOWED.items():
        for source, value in (("flag", flags.get(name)), ("run", lookup(run, key)), ("default", lookup(defaults, key))):
            if value is not None:
                values[name], sources[name] = value, source
                break
    temperature = flags.get("temperature")
    values["temperature"] = 0.0 if temperature is None else temperature
    sources["temperature"] = "flag" if temperature is not None else "default: greedy, as the trainer's eval"
    if found is None or checkpoint is None:
        return EvalSettings(values=values, sources=sources, run_file=None, run_dir=None, defaults_name=defaults_name)
    run_file = found[1]  # RUN_DIR/config.json, or RUN_DIR/checkpoints/step_N/trainer_state.json
    run_dir = run_file.parent if run_file.name == "config.json" else checkpoint.parent.parent
    default = RolloutConfig().model_dump()
    rollout = run.get("rollout", {}) if isinstance(run.get("rollout"), dict) else {}
    protocol = {k: rollout[k] for k in PROTOCOL_KEYS if k in rollout and rollout[k] != default.get(k)}
    return EvalSettings(values=values, sources=sources, run_file=run_file, run_dir=run_dir, protocol=protocol)


def record_gateway(run_dir: Path, rollout: dict[str, Any] | None) -> None:
    """Write the gateway's `rollout` settings (its /health: passages per search, budgets, format weight) to
    RUN_DIR/gateway.json; no request carries them, so only this record lets `eval` compare. A resumed run whose
    gateway was started with other values is warned about (its batches then mix both)."""
    if rollout is None:  # a gateway that reports none (store-only cannot roll out; an older gateway)
        return
    path = run_dir / GATEWAY_FILE
    if path.is_file() and (changed := _differences(json.loads(path.read_text()), rollout)):
        log.warning("the gateway's settings changed since this run last started: %s", "; ".join(changed))
    write_json(path, rollout)


def recorded_gateway(run_dir: Path | None) -> dict[str, Any] | None:
    """The gateway settings a run recorded (RUN_DIR/gateway.json, `record_gateway`); None where there are none."""
    path = run_dir / GATEWAY_FILE if run_dir is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def gateway_flags(rollout: dict[str, Any]) -> list[str]:
    """The `sisrl-gateway serve` flags that start a gateway with these settings: each /health `rollout` key is
    the GatewaySettings field of that name (`{"topk": 2}` -> `--topk 2`)."""
    return [arg for key, value in rollout.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def gateway_note(run_dir: Path | None, rollout: dict[str, Any] | None) -> str:
    """What the eval line says of the gateway's own settings (`rollout` from its /health) against the run's."""
    if rollout is None:
        return "the gateway reports no rollout settings (passages per search, budgets): not compared"
    shown = " ".join(f"{key}={value}" for key, value in rollout.items())
    recorded = recorded_gateway(run_dir)
    if recorded is None:
        return f"gateway (set at its start, not per request): {shown}; the run recorded none to compare"
    changed = _differences(recorded, rollout)
    if not changed:
        return f"gateway (set at its start, not per request): {shown}, as in the run"
    return (f"gateway (set at its start, not per request): {shown}; NOT as in the run: {'; '.join(changed)} "
            f"(restart the gateway with the run's values to evaluate as it trained)")


def _differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key now (run: before)` for each key whose value differs."""
    return [f"{key} {now.get(key)} (run: {value})" for key, value in before.items() if now.get(key) != value]


def em_by_source(trajs: list[Trajectory]) -> dict[str, float]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[t.data_source].append(t)
    out: dict[str, float] = {}
    for source, ts in sorted(groups.items()):
        out[f"eval/em/{source}"] = sum(t.reward_parts.get("em", 0.0) for t in ts) / len(ts)
        out[f"eval/f1/{source}"] = sum(t.reward_parts.get("f1", 0.0) for t in ts) / len(ts)
        out[f"eval/count/{source}"] = float(len(ts))
    out["eval/em"] = sum(t.reward_parts.get("em", 0.0) for t in trajs) / max(1, len(trajs))
    out["eval/searches_per_traj"] = sum(len(t.turns) for t in trajs) / max(1, len(trajs))
    return out


def evaluate(client: GatewayClient, items: list[QAItem], *, run: str, step: int, version: int, cfg: RolloutConfig,
             k: int, seed: int, temperature: float = 0.0, key: str | None = None) -> dict[str, float]:
    """One sample per question (greedy at temperature 0) from the policy the gateway serves now; EM / F1 per
    data source. `key`: the batch's idempotency key (default `RUN-eval:STEP`, which a resumed run's repeated
    evaluation reuses, getting the stored batch back)."""
    eval_cfg = cfg.model_copy(update={"samples_per_prompt": 1, "temperature": temperature})
    body = client.rollout_body(run=f"{run}-eval", step=step, policy_version=version, items=items, cfg=eval_cfg, k=k,
                               seed=seed, key=key)
    batch_id = client.submit_body(body)  # with its body, `wait` resumes the batch if the gateway restarts
    return em_by_source(client.wait_arrow(batch_id, timeout_s=cfg.timeout_s, poll_s=cfg.poll_interval_s, body=body))
