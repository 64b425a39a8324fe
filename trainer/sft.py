"""`sisrl-train sft`: a supervised warm start on trajectories stored at the gateway.

Demonstrations are read over REST (`GET /v1/rollouts?run=&data_source=&reward_min=`, then each trajectory's
token arrays) and trained on token-exactly: the stored prompt and response ids go into the model unchanged, and
only tokens with loss mask 1 (sampled by the demonstrating policy) enter the loss; tokens the environment
inserted (retrieved passages, corrective messages) are context only. The loss is the token-mean negative
log-likelihood over those tokens of one optimizer batch. The result is a Hugging Face directory
(`RUN_DIR/hf`) that the gateway loads (`POST /v1/policy`) and `sisrl-train train` starts from (`model.path`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from sisrl.trainer.batch import RolloutBatch, Trajectory, collate
from sisrl.trainer.config import SFTConfig, TrainConfig
from sisrl.trainer.distributed import pick_device
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.metrics import MetricsWriter
from sisrl.trainer.policy import (
    build_optimizer,
    build_scheduler,
    load_policy,
    policy_logits,
    save_hf_directory,
)
from sisrl.trainer.sis import gather_logprobs
from torch import Tensor, nn
from tqdm import tqdm

log = logging.getLogger(__name__)
SFT_DIR = "hf"  # RUN_DIR/hf: the warm-started policy as a Hugging Face directory


def fetch_demonstrations(client: GatewayClient, cfg: SFTConfig, *, seed: int = 0,
                         progress: bool = True) -> list[Trajectory]:
    """The stored trajectories of `cfg.runs` that pass the filters, with their token arrays; with
    `max_trajectories`, a seeded random subset of them (store order is completion order: short one-hop
    trajectories finish first, so its head would under-represent two-hop questions)."""
    if not cfg.runs:
        raise ValueError("sft.runs is empty: name the gateway run(s) whose trajectories are the demonstrations")
    summaries = []
    for run in cfg.runs:
        summaries += client.list_rollouts(run=run, data_source=cfg.data_source, reward_min=cfg.reward_min)
    # A stable order first: the store's is completion order, which varies with timing, and the subset and the
    # batches drawn from it must be the same in every run with this seed.
    summaries.sort(key=lambda s: (str(s.get("run")), str(s.get("item_id")), int(s.get("sample_index") or 0), str(s["id"])))
    if cfg.max_trajectories is not None and len(summaries) > cfg.max_trajectories:
        summaries = random.Random(f"{seed}:demonstrations").sample(summaries, cfg.max_trajectories)
    if not summaries:
        raise ValueError(f"no stored trajectory matches sft.runs={cfg.runs}, sft.data_source={cfg.data_source!r}, "
                         f"sft.reward_min={cfg.reward_min}")
    ids = [str(s["id"]) for s in summaries]
    return [client.get_rollout(i) for i in tqdm(ids, desc="demonstrations", unit="traj", disable=not progress)]


def sft_batch(trajs: list[Trajectory], *, pad_id: int) -> RolloutBatch:
    """Padded tensors whose `mask` [B, T] is exactly the stored loss mask (1 = trained on)."""
    b = collate(trajs, pad_id=pad_id, k=1)
    mask = torch.zeros_like(b.mask)
    for i, tr in enumerate(trajs):
        mask[i, : len(tr.loss_mask)] = torch.tensor(tr.loss_mask, dtype=mask.dtype)
    return b.with_mask(mask)


def masked_nll(logp: Tensor, mask: Tensor, total_tokens: float) -> Tensor:
    """Sum over masked tokens of -log pi(y_t), divided by the optimizer batch's token count.

    logp, mask: [B, T]. Summed over the micro-batches of one optimizer batch this is the token-mean NLL.
    """
    # where, not a product: a NaN/inf log-prob at a masked (inserted or padded) position must not leak
    return -torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum() / max(total_tokens, 1.0)


def sft_update(model: nn.Module, b: RolloutBatch, *, micro: int, chunk_size: int | None,
               autocast: bool, compact: bool = False, shared_prefix: bool = False) -> tuple[float, float]:
    """Forward/backward of one optimizer batch in micro-batches; returns (mean NLL, tokens). No step here."""
    total = float(b.mask.sum())
    loss_sum = 0.0
    for idx in torch.arange(b.size).split(micro):
        mb = b.select(idx)
        logits, mb = policy_logits(model, mb, autocast=autocast, compact=compact, shared_prefix=shared_prefix)
        logp = gather_logprobs(logits, mb.response_ids, 1.0, chunk_size)
        loss = masked_nll(logp, mb.mask, total)  # [B, T] -> scalar
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum, total


@dataclass(frozen=True)
class SFTResult:
    path: Path  # the HF directory of the trained policy
    steps: int
    demonstrations: int
    history: list[dict[str, float]]


def _batches(n: int, cfg: SFTConfig, seed: int) -> list[list[int]]:
    """Index lists of the optimizer batches: `epochs` seeded shuffles, cut at `max_steps`."""
    out: list[list[int]] = []
    for epoch in range(cfg.epochs):
        order = list(range(n))
        random.Random(f"{seed}:sft:{epoch}").shuffle(order)
        out += [order[i : i + cfg.batch_size] for i in range(0, n, cfg.batch_size)]
    return out[: cfg.max_steps] if cfg.max_steps is not None else out


def train_sft(cfg: TrainConfig, demos: list[Trajectory] | None = None) -> SFTResult:
    """Warm-start `cfg.model` on the demonstrations (fetched per `cfg.sft` when not given); writes RUN_DIR/hf."""
    run_dir = Path(cfg.run_dir)
    if demos is None:
        client = GatewayClient(cfg.rollout.gateway_url, token=cfg.rollout.api_token)
        demos = fetch_demonstrations(client, cfg.sft, seed=cfg.seed, progress=cfg.progress)
    device = pick_device(cfg.device, local_rank=0)  # one process: the warm start is short
    torch.manual_seed(cfg.seed)
    model_cfg = cfg.model.model_copy(update={"trainable_layers": cfg.sft.trainable_layers})
    model, tokenizer = load_policy(model_cfg, seed=cfg.seed, device=device)
    batches = _batches(len(demos), cfg.sft, cfg.seed)
    optim = cfg.optim if cfg.sft.lr is None else cfg.optim.model_copy(update={"lr": cfg.sft.lr})
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, len(batches))
    writer = MetricsWriter(run_dir, tensorboard=cfg.tensorboard)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
    history: list[dict[str, float]] = []
    pad_id = int(tokenizer.pad_token_id)
    try:
        for step, rows in enumerate(tqdm(batches, desc="sft", unit="step", disable=not cfg.progress), start=1):
            t0 = time.perf_counter()
            b = sft_batch([demos[i] for i in rows], pad_id=pad_id).to(device)
            nll, tokens = sft_update(model, b, micro=cfg.optim.micro_batch_size or b.size,
                                     chunk_size=cfg.model.logprob_chunk_size, autocast=cfg.model.autocast_bf16,
                                     compact=cfg.model.compact_logits, shared_prefix=cfg.model.shared_prefix)
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else math.inf
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            dt = time.perf_counter() - t0
            metrics = {"sft/nll": nll, "sft/tokens": tokens, "sft/grad_norm": norm,
                       "sft/lr": float(scheduler.get_last_lr()[0]), "perf/train_tokens_per_s": tokens / dt,
                       "time/step_s": dt}
            writer.log(step, metrics)
            history.append(metrics)
    finally:
        writer.close()
    path = save_hf_directory(model, tokenizer, run_dir / SFT_DIR)
    (run_dir / "sft_state.json").write_text(json.dumps({"steps": len(batches), "demonstrations": len(demos),
                                                        "runs": cfg.sft.runs, "path": str(path)}, indent=1))
    return SFTResult(path=path, steps=len(batches), demonstrations=len(demos), history=history)
