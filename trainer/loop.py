"""The training loop: sample questions -> rollouts -> update -> push weights -> metrics -> checkpoint.

`train(cfg)` is what `sisrl-train train` and `torchrun ... sisrl-train train` run. It reads top to bottom;
the policy update itself is `trainer/update.py`, the math `trainer/{sis,losses,advantages}.py`.
Step j trains on rollout batch j and turns policy version j into j + 1. Through the gateway, batches are
submitted by `trainer/pipeline.py`: in sync mode batch j + 1 right after version j + 1 is pushed; in async mode
up to `rollout.max_staleness` batches ahead, generated while the trainer updates (docs/trainer.md, "Async").
"""

from __future__ import annotations

import copy
import logging
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from sisrl.common.atomic import sweep_temps
from sisrl.trainer.arrow_batch import (
    collate_trajectories,
    release_unused_memory,
    trajectories_from_ipc,
    trajectories_to_ipc,
)
from sisrl.trainer.batch import Trajectory
from sisrl.trainer.checkpoint import read_latest, restore, save_checkpoint
from sisrl.trainer.config import ConfigError, TrainConfig
from sisrl.trainer.data import MixtureSampler, QAItem, load_items
from sisrl.trainer.distributed import (
    DistContext,
    barrier,
    broadcast_bytes,
    init_distributed,
    mean_over_ranks,
    shutdown,
    wrap_model,
    wrap_reference,
)
from sisrl.trainer.evaluate import evaluate, record_gateway
from sisrl.trainer.gateway_client import Announced, GatewayClient, GatewayError, GatewaySource, RetryPolicy
from sisrl.trainer.metrics import MetricsWriter, rollout_metrics, staleness_metrics, table_header, table_row
from sisrl.trainer.node import check_gateway
from sisrl.trainer.pipeline import RolloutPipeline, Taken
from sisrl.trainer.policy import (
    build_optimizer,
    build_scheduler,
    load_policy,
    unwrap,
)
from sisrl.trainer.push import push_shard_bytes, resolve_push_dtype, write_push
from sisrl.trainer.sampling import SyntheticSource
from sisrl.trainer.update import TokenRecord, Updater, train_on_batch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

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
        return SyntheticSource(unwrap(model), cfg.rollout, k=cfg.algorithm.logprobs_k, seed=cfg.seed,
                               vocab_size=vocab_size)
    client = GatewayClient(cfg.rollout.gateway_url, token=cfg.rollout.api_token,
                           retry=RetryPolicy(budget_s=cfg.rollout.retry_budget_s))
    return GatewaySource(client, cfg.rollout, run=run_name(Path(cfg.run_dir), cfg.seed), k=cfg.algorithm.logprobs_k,
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


@dataclass
class Session:
    """Everything one training process holds. `step` / `version` advance as it trains; no formula here."""

    ctx: DistContext
    run_dir: Path
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator  # SIS accept draws and mini-batch shuffles (on the model's device: sis.py draws there)
    updater: Updater
    sampler: MixtureSampler | None  # rank 0 only
    source: RolloutSource | None  # rank 0 only
    writer: MetricsWriter | None  # rank 0 only
    pipeline: RolloutPipeline | None = None  # rank 0, gateway source only
    pusher: WeightPusher | None = None  # rank 0, async mode only
    push_dtype: torch.dtype = torch.float32  # of the pushed weights (rank 0 converts; the others only gather)
    step: int = 0
    version: int = 0


def setup(cfg: TrainConfig) -> Session:
    """Process group, seeded model, optimizer, schedule, data, rollout source; resume from the newest checkpoint."""
    if cfg.rollout.source == "gateway" and not cfg.data.train:
        raise ConfigError("data.train: training through the gateway needs at least one question file")
    ctx = init_distributed(cfg.distributed, cfg.device)
    if cfg.rollout.source == "gateway" and ctx.is_main:  # before the model loads: a missing gateway is named at once
        probe = GatewayClient(cfg.rollout.gateway_url, token=cfg.rollout.api_token)
        try:
            probe.check_reachable()
            check_gateway(cfg, probe.health().get("rollout"))  # one that would cut this config's trajectories
        finally:
            probe.close()
    seed_everything(cfg.seed)  # the same on every rank: identical initial weights
    run_dir = Path(cfg.run_dir)
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed, device=ctx.device)
    ref_model = copy.deepcopy(model) if cfg.algorithm.kl_coef > 0 else None  # only with a KL penalty
    model = wrap_model(model, ctx, cfg.distributed.strategy)
    ref_model = None if ref_model is None else wrap_reference(ref_model, ctx, cfg.distributed.strategy)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.total_steps * cfg.algorithm.staleness)
    generator = torch.Generator(device=ctx.device).manual_seed(cfg.seed * 7919 + ctx.rank)
    if ctx.is_main:  # what a save killed midway left (docs/trainer.md, "Checkpoint and resume")
        sweep_temps(run_dir / "checkpoints", run_dir / "policy")
    ckpt = read_latest(run_dir, rank=ctx.rank, world=ctx.world,  # all ranks fall back past a torn one together
                       agree=lambda ok: mean_over_ranks({"ok_min": float(ok)}, ctx)["ok_min"] == 1.0,
                       ) if cfg.resume else None
    if ckpt is None and ctx.is_main:
        (run_dir / "run_name.txt").unlink(missing_ok=True)  # a fresh run gets a fresh name at the gateway
    updater = Updater(model=model, optimizer=optimizer, scheduler=scheduler, algo=cfg.algorithm, optim=cfg.optim,
                      temperature=cfg.rollout.temperature, chunk_size=cfg.model.logprob_chunk_size,
                      autocast=cfg.model.autocast_bf16, ref_model=ref_model, rank=ctx.rank, world=ctx.world,
                      compact_logits=cfg.model.compact_logits, shared_prefix=cfg.model.shared_prefix)
    s = Session(ctx=ctx, run_dir=run_dir, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                generator=generator, updater=updater, sampler=build_sampler(cfg) if ctx.is_main else None,
                source=build_source(cfg, model, len(tokenizer)) if ctx.is_main else None, writer=None)
    if ctx.is_main and isinstance(s.source, GatewaySource):
        assert s.sampler is not None
        _check_partial(cfg, s.source.client)
        s.push_dtype = resolve_push_dtype(cfg.model.push_dtype, served=s.source.client.health().get("weights_dtype"),
                                          trained=cfg.model.dtype)
        log.info("weight pushes: %s, shards of at most %d MiB", s.push_dtype, cfg.model.push_shard_mb)
        s.pipeline = RolloutPipeline.for_run(s.source, s.sampler, cfg.rollout, total_steps=cfg.total_steps,
                                             resumed=ckpt is not None)
        if cfg.rollout.mode == "async":
            s.pusher = WeightPusher(cfg, s.source.client.announced)
    if ckpt is not None:
        state = restore(ckpt, model=model, optimizer=optimizer, scheduler=scheduler, generator=generator)
        s.step, s.version = state.step, state.policy_version
        if s.sampler is not None:
            s.sampler.load_state(state.sampler)
        log.info("resumed from %s (step %d, policy version %d)", ckpt.path, s.step, s.version)
        _push_weights(cfg, s, wait=True)  # the gateway serves the resumed policy
        if s.pipeline is not None:
            s.pipeline.restore(state.inflight, s.step)  # the batches in flight at the checkpoint, by their keys
    elif s.pipeline is not None and s.pipeline.source.client.health().get("policy_version") != 0:
        # A fresh run is policy version 0; a gateway still serving another run's version would sample this
        # run's first batches with weights it never had (and the staleness bound would drop them).
        log.info("the gateway serves another policy version: pushing this run's initial weights as version 0")
        _push_weights(cfg, s, wait=True)
    if ctx.is_main:
        s.writer = MetricsWriter(run_dir, tensorboard=cfg.tensorboard, start_step=s.step)
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
        if isinstance(s.source, GatewaySource):  # what no request carries, for `sisrl-train eval` to compare
            record_gateway(run_dir, s.source.client.health().get("rollout"))
    return s


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> list[dict[str, float]]:
    """Train `cfg.total_steps` rollout batches (resuming from the newest checkpoint when `cfg.resume`).

    `stop_after` ends the run after that many steps of this call (a clean "kill" for the resume test).
    Returns rank 0's metrics per step (empty on other ranks).
    """
    s = setup(cfg)
    history: list[dict[str, float]] = []
    show = s.ctx.is_main and cfg.progress
    bar = tqdm(total=cfg.total_steps, initial=s.step, desc="train", unit="step", disable=not show)
    if show:
        bar.write(table_header())
    start = s.step
    try:
        while s.step < cfg.total_steps and (stop_after is None or s.step - start < stop_after):
            metrics = run_step(cfg, s)
            if s.writer is not None:
                s.writer.log(s.step, metrics)
                history.append(metrics)
                if show:
                    bar.write(table_row(s.step, metrics))
                bar.update(1)
    finally:
        bar.close()
        if s.pusher is not None:
            s.pusher.close()
        if s.writer is not None:
            s.writer.close()
        shutdown(s.ctx)
    return history


def run_step(cfg: TrainConfig, s: Session) -> dict[str, float]:
    """Rollouts -> update -> push weights -> submit what may run ahead -> checkpoint -> (eval); returns the
    step's metrics (rank 0's)."""
    t0 = time.perf_counter()
    taken = _rollouts(s.ctx, s, cfg)
    trajs = taken.trajectories
    t1 = time.perf_counter()
    single = s.ctx.world == 1
    records: list[TokenRecord] | None = [] if single else None
    metrics: dict[str, float] = {}
    train_tokens = 0.0
    if trajs:
        # batch.collate's tensors, placed by numpy scatters a page at a time instead of a Python loop over tokens
        b = collate_trajectories(trajs, pad_id=int(s.tokenizer.pad_token_id),
                                 k=cfg.algorithm.logprobs_k).to(s.ctx.device)
        train_tokens = float(b.mask.sum())
        metrics = mean_over_ranks(train_on_batch(s.updater, b, s.generator, records), s.ctx)
        if records and cfg.sis_records and isinstance(s.source, GatewaySource):
            _post_sis_records(cfg, s, trajs, records)
    else:  # every trajectory of the batch was outside the staleness bound
        log.warning("step %d: nothing left to train on; the policy does not change this step", s.step + 1)
    metrics.update(staleness_metrics(trajs, s.version, records, dropped=taken.dropped))
    t2 = time.perf_counter()
    s.step, s.version = s.step + 1, s.version + 1
    # then the batches the new version allows: sync the next one, async up to max_staleness ahead (async: in
    # the push thread, once the push has landed)
    _push_weights(cfg, s, wait=s.pusher is None, then=s.pipeline.fill if s.pipeline is not None else None)
    t3 = time.perf_counter()
    if s.step % cfg.checkpoint_every == 0 or s.step == cfg.total_steps:
        sampler, inflight = (s.pipeline.snapshot() if s.pipeline is not None
                             else (s.sampler.state() if s.sampler is not None else {}, []))
        save_checkpoint(s.run_dir, step=s.step, policy_version=s.version, model=s.model, optimizer=s.optimizer,
                        scheduler=s.scheduler, generator=s.generator, sampler=sampler,
                        config=cfg.model_dump(mode="json"), rank=s.ctx.rank, world=s.ctx.world,
                        keep=cfg.keep_checkpoints, barrier=(lambda: barrier(s.ctx)) if s.ctx.enabled else None,
                        inflight=inflight)
    t4 = time.perf_counter()
    if cfg.eval_every and s.step % cfg.eval_every == 0 and isinstance(s.source, GatewaySource):
        if s.pusher is not None:
            s.pusher.wait()  # evaluate the version just trained
        metrics.update(_evaluate(cfg, s.source, s.step, s.version))
    metrics.update(rollout_metrics(trajs, t1 - t0))
    metrics["rollout/errors"] = float(taken.errored)
    metrics.update({
        "time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/sync_s": t3 - t2, "time/checkpoint_s": t4 - t3,
        "time/step_s": t4 - t0, "policy/version": float(s.version),
        "perf/train_tokens_per_s": train_tokens * cfg.algorithm.staleness / max(t2 - t1, 1e-9),
    })
    return metrics


def _rollouts(ctx: DistContext, s: Session, cfg: TrainConfig) -> Taken:
    """Rank 0 takes the step's batch (the pipeline, or the synthetic source); every rank gets the same one."""
    raw: bytes | None = None
    taken = Taken([])
    if ctx.is_main:
        if s.pipeline is not None:
            if s.pusher is not None and not s.pipeline.has(s.step):
                s.pusher.wait()  # the batch is submitted once the push of its version lands
            taken = s.pipeline.take(s.step, s.version)
        else:
            assert s.source is not None
            items = s.sampler.next_items(cfg.rollout.prompts_per_step) if s.sampler is not None else []
            taken = Taken(s.source.rollouts(items, s.step, s.version))
        if not ctx.enabled:
            return taken
        raw = trajectories_to_ipc(taken.trajectories)  # one binary broadcast (Arrow IPC), never pickle
        # rank 0 trains on the decoded copy, as every rank does: its own pages go now, not after the step
        taken = Taken([], dropped=taken.dropped, errored=taken.errored)
    trajs = trajectories_from_ipc(broadcast_bytes(raw, ctx))
    del raw
    release_unused_memory()
    return Taken(trajs, dropped=taken.dropped, errored=taken.errored) if ctx.is_main else Taken(trajs)


def _check_partial(cfg: TrainConfig, client: GatewayClient) -> None:
    """Async with partial rollouts needs a gateway whose weight loads can land inside a trajectory."""
    if cfg.rollout.mode != "async" or not cfg.rollout.partial:
        return
    granularity = client.health().get("load_granularity")
    if granularity is None:
        raise ConfigError(f"rollout.partial=true: the gateway at {cfg.rollout.gateway_url} cannot load weights "
                          "inside running trajectories (its /health has no load_granularity; a store-only or "
                          "older gateway); set rollout.partial=false or serve with a current sisrl-gateway")
    log.info("partial rollouts: weight loads land between %ss of running trajectories", granularity)


def _post_sis_records(cfg: TrainConfig, s: Session, trajs: list[Trajectory], records: list[TokenRecord]) -> None:
    """Per-token SIS outcomes of this step's update, for the viewer (`POST /v1/sis_records`; `sis_records_max`
    keeps a seeded sample). A refused post is logged and training goes on: the records are diagnostics."""
    assert isinstance(s.source, GatewaySource)
    if cfg.sis_records_max is not None and len(records) > cfg.sis_records_max:
        records = random.Random(f"{cfg.seed}:sis:{s.step}").sample(records, cfg.sis_records_max)
    body = []
    for rec in records:
        traj = trajs[rec.row]
        n = len(traj.response_ids)
        body.append({"trajectory_id": traj.id, "policy_version": s.version, "advantage": rec.advantage,
                     "status": rec.status[:n], "ratio": rec.ratio[:n], "logp": rec.logp[:n], "log_m": rec.log_m[:n]})
    try:
        s.source.client.post_sis_records(s.source.run, s.step, body)
    except (GatewayError, ValueError) as err:
        log.warning("SIS records of step %d not stored: %s", s.step, err)


def _evaluate(cfg: TrainConfig, source: GatewaySource, step: int, version: int) -> dict[str, float]:
    """EM / F1 per data source on the eval files, at the version just pushed."""
    items = [it for path in cfg.data.eval for it in load_items(path, limit=cfg.data.eval_limit)]
    if not items:
        return {}
    return evaluate(source.client, items, run=source.run, step=step, version=version, cfg=cfg.rollout,
                    k=cfg.algorithm.logprobs_k, seed=cfg.seed)


def _push_weights(cfg: TrainConfig, s: Session, *, wait: bool = True,
                  then: Callable[[int], None] | None = None) -> None:
    """Save the policy as a sharded HF safetensors directory in the push dtype (`trainer/push.py`) and announce it
    (`POST /v1/policy`), then call `then(version)`; rank 0 writes, and under FSDP2 every rank joins the gathers.
    `wait=False` (async mode): the announcement and `then` run in the push thread while the trainer goes on."""
    needs = s.source.needs_weights if s.source is not None else cfg.rollout.source == "gateway"
    if not needs:
        return
    root = s.run_dir.resolve() / "policy"
    out = root / f"v{s.version:06d}"
    if s.ctx.is_main and s.pusher is not None:
        s.pusher.wait()  # one push at a time: the previous one has landed before its files can go
    gathers = cfg.distributed.strategy == "fsdp2" and s.ctx.enabled  # DDP and one process: rank 0 alone writes
    if s.ctx.is_main or gathers:
        write_push(s.model, s.tokenizer, out, dtype=s.push_dtype,
                   max_shard_bytes=push_shard_bytes(cfg.model.push_shard_mb), is_main=s.ctx.is_main)
    if s.ctx.is_main:
        assert s.source is not None
        for old in sorted(root.glob("v*"))[:-2]:  # keep this version and the one the gateway serves now
            shutil.rmtree(old, ignore_errors=True)
        if s.pusher is not None:
            s.pusher.push(out, s.version, then)
            if wait:
                s.pusher.wait()
        else:
            s.source.push_policy(out, s.version)
            if then is not None:
                then(s.version)
    barrier(s.ctx)


class WeightPusher:
    """`POST /v1/policy` from a background thread with its own HTTP client (async mode): the trainer does not
    wait while the gateway loads the weights (with `rollout.partial=false`, until its running trajectories end).
    A failed push is raised by the next `wait`."""

    def __init__(self, cfg: TrainConfig, announced: Announced) -> None:
        # `announced` is the trainer client's: pushes stay in order, and a restarted gateway gets the newest one
        self.client = GatewayClient(cfg.rollout.gateway_url, token=cfg.rollout.api_token, timeout_s=cfg.rollout.timeout_s,
                                    retry=RetryPolicy(budget_s=cfg.rollout.retry_budget_s), announced=announced)
        self.partial = cfg.rollout.partial
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def push(self, path: Path, version: int, then: Callable[[int], None] | None = None) -> None:
        """Announce `path` as `version` in the background, then call `then(version)` there."""
        self.wait()

        def run() -> None:
            try:
                self.client.push_policy(path, version, partial=self.partial)
                if then is not None:
                    then(version)
            except BaseException as err:  # re-raised in the trainer's thread by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name=f"sisrl-push-v{version}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.client.close()
