"""The training loop: sample questions -> rollouts -> update -> push weights -> metrics -> checkpoint.

`train(cfg)` is what `sisrl-train train` and `torchrun ... sisrl-train train` run. It reads top to bottom;
the policy update itself is `trainer/update.py`, the math `trainer/{sis,losses,advantages}.py`.
"""

from __future__ import annotations

import copy
import logging
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from sisrl.trainer.batch import Trajectory, collate, trajectories_from_bytes, trajectories_to_bytes
from sisrl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from sisrl.trainer.config import TrainConfig
from sisrl.trainer.data import MixtureSampler, QAItem, load_items
from sisrl.trainer.distributed import (
    DistContext,
    barrier,
    broadcast_bytes,
    init_distributed,
    mean_over_ranks,
    shutdown,
    wrap_model,
)
from sisrl.trainer.evaluate import evaluate
from sisrl.trainer.gateway_client import GatewayClient, GatewaySource
from sisrl.trainer.metrics import MetricsWriter, rollout_metrics, table_header, table_row
from sisrl.trainer.policy import (
    build_optimizer,
    build_scheduler,
    full_state_dict,
    load_policy,
    save_hf_directory,
    unwrap,
)
from sisrl.trainer.sampling import SyntheticSource
from sisrl.trainer.update import Updater, train_on_batch
from tqdm import tqdm

log = logging.getLogger(__name__)


class RolloutSource(Protocol):
    needs_weights: bool

    def rollouts(self, items: list[QAItem], step: int, version: int) -> list[Trajectory]: ...

    def push_policy(self, path: Path | None, version: int) -> None: ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_sampler(cfg: TrainConfig) -> MixtureSampler | None:
    if not cfg.data.train:
        return None
    sources = [load_items(f.path, f.data_source) for f in cfg.data.train]
    return MixtureSampler(sources, [f.weight for f in cfg.data.train], seed=cfg.seed)


def build_source(cfg: TrainConfig, model: torch.nn.Module, vocab_size: int) -> RolloutSource:
    if cfg.rollout.source == "synthetic":
        return SyntheticSource(unwrap(model), cfg.rollout, k=cfg.algorithm.topk, seed=cfg.seed, vocab_size=vocab_size)
    client = GatewayClient(cfg.rollout.gateway_url, token=cfg.rollout.api_token)
    return GatewaySource(client, cfg.rollout, run=run_name(Path(cfg.run_dir), cfg.seed), k=cfg.algorithm.topk,
                         seed=cfg.seed)


def run_name(run_dir: Path, seed: int) -> str:
    """The run's name at the gateway: folder, seed and first-start time, fixed in RUN_DIR/run_name.txt so a
    resumed run keeps it (and its idempotency keys) while a fresh run in a reused folder never collides."""
    path = run_dir / "run_name.txt"
    if path.is_file():
        return path.read_text().strip()
    name = re.sub(r"[^A-Za-z0-9._-]", "-", f"{run_dir.name}-s{seed}-{time.strftime('%Y%m%dT%H%M%S')}")[:64]
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(name + "\n")
    return name


def train(cfg: TrainConfig, *, stop_after: int | None = None,
          on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Train `cfg.total_steps` rollout batches (resuming from the newest checkpoint when `cfg.resume`).

    `stop_after` ends the run after that many steps of this call (a clean "kill" for the resume test);
    `on_step(step, metrics)` is called on rank 0 after each step. Returns rank 0's metrics per step.
    """
    ctx = init_distributed(cfg.distributed, cfg.device)
    seed_everything(cfg.seed)  # the same on every rank: identical initial weights
    run_dir = Path(cfg.run_dir)
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed, device=ctx.device)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algorithm.kl_coef > 0 else None
    model = wrap_model(model, ctx, cfg.distributed.strategy)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.total_steps * cfg.algorithm.staleness)
    # SIS accept draws and mini-batch shuffles; on the model's device because sis.py draws u there.
    generator = torch.Generator(device=ctx.device).manual_seed(cfg.seed * 7919 + ctx.rank)
    ckpt = latest_checkpoint(run_dir) if cfg.resume else None
    if ckpt is None and ctx.is_main:
        (run_dir / "run_name.txt").unlink(missing_ok=True)  # a fresh run gets a fresh name at the gateway
    sampler = build_sampler(cfg) if ctx.is_main else None
    source = build_source(cfg, model, len(tokenizer)) if ctx.is_main else None
    step, version = 0, 0
    if ckpt is not None:
        state = load_checkpoint(ckpt, model=model, optimizer=optimizer, scheduler=scheduler, generator=generator,
                                rank=ctx.rank, world=ctx.world)
        step, version = state.step, state.policy_version
        if sampler is not None:
            sampler.load_state(state.sampler)
        log.info("resumed from %s (step %d, policy version %d)", ckpt, step, version)
    updater = Updater(model=model, optimizer=optimizer, scheduler=scheduler, algo=cfg.algorithm, optim=cfg.optim,
                      temperature=cfg.rollout.temperature, chunk_size=cfg.model.logprob_chunk_size,
                      autocast=cfg.model.autocast_bf16, ref_model=ref_model, rank=ctx.rank, world=ctx.world)
    writer = MetricsWriter(run_dir, tensorboard=cfg.tensorboard, start_step=step) if ctx.is_main else None
    if ctx.is_main:
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
    if ckpt is not None:
        _push_weights(cfg, ctx, source, model, tokenizer, version)  # the gateway serves the resumed policy
    history: list[dict[str, float]] = []
    bar = tqdm(total=cfg.total_steps, initial=step, desc="train", unit="step",
               disable=not (ctx.is_main and cfg.progress))
    if ctx.is_main and cfg.progress:
        bar.write(table_header())
    start = step
    try:
        while step < cfg.total_steps and (stop_after is None or step - start < stop_after):
            t0 = time.perf_counter()
            trajs = _rollouts(ctx, source, sampler, cfg, step, version)
            t1 = time.perf_counter()
            b = collate(trajs, pad_id=int(tokenizer.pad_token_id), k=cfg.algorithm.topk).to(ctx.device)
            metrics = mean_over_ranks(train_on_batch(updater, b, generator), ctx)
            t2 = time.perf_counter()
            step, version = step + 1, version + 1
            _push_weights(cfg, ctx, source, model, tokenizer, version)
            t3 = time.perf_counter()
            if step % cfg.checkpoint_every == 0 or step == cfg.total_steps:
                save_checkpoint(run_dir, step=step, policy_version=version, model=model, optimizer=optimizer,
                                scheduler=scheduler, generator=generator,
                                sampler=sampler.state() if sampler is not None else {},
                                config=cfg.model_dump(mode="json"), rank=ctx.rank, world=ctx.world,
                                keep=cfg.keep_checkpoints, barrier=(lambda: barrier(ctx)) if ctx.enabled else None)
            t4 = time.perf_counter()
            if ctx.is_main and cfg.eval_every and step % cfg.eval_every == 0 and isinstance(source, GatewaySource):
                metrics.update(_evaluate(cfg, source, step, version))
            if ctx.is_main:
                metrics.update(rollout_metrics(trajs, t1 - t0))
                metrics.update({"time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/sync_s": t3 - t2,
                                "time/checkpoint_s": t4 - t3, "time/step_s": t4 - t0, "policy/version": float(version),
                                "perf/train_tokens_per_s": float(b.mask.sum()) * cfg.algorithm.staleness / max(t2 - t1, 1e-9)})
                assert writer is not None
                writer.log(step, metrics)
                history.append(metrics)
                if cfg.progress:
                    bar.write(table_row(step, metrics))
                bar.update(1)
                if on_step is not None:
                    on_step(step, metrics)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        shutdown(ctx)
    return history


def _rollouts(ctx: DistContext, source: RolloutSource | None, sampler: MixtureSampler | None, cfg: TrainConfig,
              step: int, version: int) -> list[Trajectory]:
    """Rank 0 asks the source for a batch; every rank gets the same trajectories."""
    raw: bytes | None = None
    if ctx.is_main:
        assert source is not None
        items = sampler.next_items(cfg.rollout.prompts_per_step) if sampler is not None else []
        trajs = source.rollouts(items, step, version)
        if not ctx.enabled:
            return trajs
        raw = trajectories_to_bytes(trajs)
    return trajectories_from_bytes(broadcast_bytes(raw, ctx))


def _evaluate(cfg: TrainConfig, source: GatewaySource, step: int, version: int) -> dict[str, float]:
    """EM / F1 per data source on the eval files, at the version just pushed."""
    items = [it for path in cfg.data.eval for it in load_items(path, limit=cfg.data.eval_limit)]
    if not items:
        return {}
    return evaluate(source.client, items, run=source.run, step=step, version=version, cfg=cfg.rollout,
                    k=cfg.algorithm.topk, seed=cfg.seed)


def _push_weights(cfg: TrainConfig, ctx: DistContext, source: RolloutSource | None, model: torch.nn.Module,
                  tokenizer: object, version: int) -> None:
    """Save the policy as an HF safetensors directory and announce it (`POST /v1/policy`); rank 0 writes."""
    needs = source.needs_weights if source is not None else cfg.rollout.source == "gateway"
    if not needs:
        return
    state = full_state_dict(model) if cfg.distributed.strategy == "fsdp2" and ctx.enabled else None  # collective
    if ctx.is_main:
        assert source is not None
        root = Path(cfg.run_dir).resolve() / "policy"
        path = save_hf_directory(model, tokenizer, root / f"v{version:06d}", state=state)  # type: ignore[arg-type]
        source.push_policy(path, version)
        for old in sorted(root.glob("v*"))[:-2]:  # keep the served version and the one before it
            shutil.rmtree(old, ignore_errors=True)
    barrier(ctx)
