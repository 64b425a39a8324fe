"""Evaluation through the gateway: EM / F1 per data source of one policy on question files.

`sisrl-train eval --checkpoint PATH --data FILE` pushes the checkpoint's weights to the gateway (a trainer
checkpoint is first exported as a Hugging Face directory), rolls out every question once, greedily (temperature
0), and reports the mean EM and F1 per data source. The turn limits and K default to those of the run that wrote
the checkpoint (`run_config`), so a checkpoint is evaluated under the protocol it was trained with.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from sisrl.trainer.batch import Trajectory
from sisrl.trainer.checkpoint import STATE_FILE
from sisrl.trainer.config import ModelConfig, RolloutConfig
from sisrl.trainer.data import QAItem
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.policy import load_policy, save_hf_directory


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
             k: int, seed: int, temperature: float = 0.0) -> dict[str, float]:
    """One sample per question (greedy at temperature 0) from the policy the gateway serves now; EM / F1 per
    data source."""
    eval_cfg = cfg.model_copy(update={"samples_per_prompt": 1, "temperature": temperature})
    batch_id = client.submit(run=f"{run}-eval", step=step, policy_version=version, items=items, cfg=eval_cfg, k=k,
                             seed=seed)
    return em_by_source(client.wait(batch_id, timeout_s=cfg.timeout_s, poll_s=cfg.poll_interval_s))
