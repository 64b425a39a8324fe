"""One rollout batch -> advantages -> (dynamic sampling) -> N mini-batch policy updates.

Reads top to bottom (`train_on_batch`): GRPO advantages by group id, optional DAPO filter, optional recompute of
q, then for each of the N mini-batches: forward, log-probs from sis.py, the ratio from losses.compute_log_ratio,
the registered policy loss, backward, guard, step. No formula lives here; they are in sis.py, losses.py and
advantages.py. Distributed: every rank holds the whole batch; rank r trains on rows r::world of each mini-batch.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from sisrl.common.tensors import masked_mean
from sisrl.trainer.advantages import dynamic_sampling_mask, grpo_advantages
from sisrl.trainer.batch import RolloutBatch
from sisrl.trainer.config import AlgorithmConfig, OptimConfig
from sisrl.trainer.losses import (
    aggregate,
    compute_log_ratio,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
)
from sisrl.trainer.policy import no_grad_sync, response_logits
from sisrl.trainer.sis import (
    behaviour_topk,
    gather_logprobs,
    ratio_metrics,
    sis_log_ratio,
    token_and_topk_logprobs,
    token_in_topk,
)
from torch import Tensor, nn

log = logging.getLogger(__name__)
Metrics = dict[str, Tensor]


@dataclass
class Updater:
    """What an update needs besides the batch. Holds no formula."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    algo: AlgorithmConfig
    optim: OptimConfig
    temperature: float
    chunk_size: int | None = None
    autocast: bool = False
    ref_model: nn.Module | None = None
    rank: int = 0
    world: int = 1

    def loss_kwargs(self) -> dict[str, object]:
        """Clip bounds / aggregation from the config; None keeps the registered loss's own default."""
        kw: dict[str, object] = {"clip_dual": self.algo.clip_dual}
        for key in ("clip_low", "clip_high", "agg_mode"):
            value = getattr(self.algo, key)
            if value is not None:
                kw[key] = value
        return kw

    def agg_mode(self) -> str:
        if self.algo.agg_mode is not None:
            return self.algo.agg_mode
        default = inspect.signature(get_policy_loss(self.algo.loss)).parameters["agg_mode"].default
        return str(default)


def batch_advantages(b: RolloutBatch, algo: AlgorithmConfig) -> tuple[RolloutBatch, Tensor, Metrics]:
    """GRPO advantages [B] by group id, then (DAPO) drop groups whose rewards are all equal."""
    b_adv = grpo_advantages(b.rewards, b.group_ids, norm_by_std=algo.norm_adv_by_std)
    if algo.flip_advantage_sign:
        b_adv = -b_adv
    metrics: Metrics = {"rollout/kept_frac": torch.ones(())}
    if algo.dynamic_sampling:
        keep = dynamic_sampling_mask(b.rewards, b.group_ids)
        metrics["rollout/kept_frac"] = keep.float().mean()
        idx = keep.nonzero().squeeze(-1)
        b, b_adv = b.select(idx), b_adv[idx]
    return b, b_adv, metrics


@torch.no_grad()
def recompute_behaviour(model: nn.Module, b: RolloutBatch, *, k: int, temperature: float,
                        chunk_size: int | None, autocast: bool, micro: int) -> RolloutBatch:
    """`recompute` q: a no-grad forward of the rollout weights (call before any update of this batch)."""
    parts: list[tuple[Tensor, Tensor, Tensor]] = []
    for idx in torch.arange(b.size).split(micro):
        mb = b.select(idx)
        logits = response_logits(model, mb, autocast=autocast)
        parts.append(behaviour_topk(logits, mb.response_ids, k, temperature, chunk_size))
    logq, topk_ids, topk_logq = (torch.cat(xs, dim=0) for xs in zip(*parts, strict=True))
    return b.with_behaviour(logq, topk_ids, topk_logq)


def rank_shard(mb: RolloutBatch, mb_adv: Tensor, rank: int, world: int) -> tuple[RolloutBatch, Tensor]:
    """Rows rank::world of a mini-batch. Shards are made equal in size by appending a copy of row 0 with
    mask 0 (it counts nowhere), so every rank runs the same number of forward/backward passes."""
    rows = torch.arange(rank, mb.size, world)
    want = math.ceil(mb.size / world)
    if rows.numel() < want:
        rows = torch.cat([rows, torch.zeros(want - rows.numel(), dtype=torch.long)])
    shard, adv = mb.select(rows), mb_adv[rows]
    if rows.numel() > 0 and rank + world * (want - 1) >= mb.size:
        keep = torch.ones(want, 1, device=shard.mask.device)
        keep[-1] = 0.0
        shard = shard.with_mask(shard.mask * keep)
    return shard, adv


def _micro_loss(u: Updater, mb: RolloutBatch, mb_adv: Tensor, *, global_tokens: float, seq_scale: float,
                generator: torch.Generator) -> tuple[Tensor, Metrics]:
    """Loss of one micro-batch (scaled so that summing micro-batches and DDP-averaging ranks gives the
    mini-batch loss) and its detached metrics."""
    logits = response_logits(u.model, mb, autocast=u.autocast)  # [b, T, V]
    logp, topk_logp = token_and_topk_logprobs(logits, mb.response_ids, mb.topk_ids, u.temperature, u.chunk_size)
    in_topk = token_in_topk(mb.response_ids, mb.topk_ids)  # [b, T]
    ratio = compute_log_ratio(
        u.algo.ratio, logp=logp, logq=mb.logq, mask=mb.mask, topk_logp=topk_logp, topk_logq=mb.topk_logq,
        in_topk=in_topk, generator=generator, tis_cap=u.algo.tis_cap, icepop_low=u.algo.icepop_low,
        icepop_high=u.algo.icepop_high,
    )
    loss_fn = get_policy_loss(u.algo.loss)
    loss, metrics = loss_fn(log_ratio=ratio.log_ratio, advantages=mb_adv, mask=mb.mask, weights=ratio.weights,
                            global_tokens=global_tokens, dp_size=u.world, **u.loss_kwargs())  # type: ignore[arg-type]
    metrics.update(ratio.metrics)
    if u.algo.ratio != "sis":
        # D, D_SIS and the would-be accept rate as diagnostics: same test, not used by this loss.
        metrics.update(sis_log_ratio(logp=logp.detach(), logq=mb.logq, topk_logp=topk_logp, topk_logq=mb.topk_logq,
                                     in_topk=in_topk, mask=mb.mask, generator=generator).metrics)
        metrics.update(ratio_metrics(ratio.log_ratio, mb.mask.bool()))  # the ratio this loss used, not SIS's
    agg = u.agg_mode()
    with torch.set_grad_enabled(u.algo.entropy_coef > 0):
        entropy = entropy_from_logits(logits, u.chunk_size)  # [b, T]
    metrics["actor/entropy"] = masked_mean(entropy.detach(), mb.mask)
    if u.algo.entropy_coef > 0:
        loss = loss - u.algo.entropy_coef * aggregate(entropy, mb.mask, agg, global_tokens, u.world)
    if u.ref_model is not None and u.algo.kl_coef > 0:
        with torch.no_grad():
            ref_logp = gather_logprobs(response_logits(u.ref_model, mb, autocast=u.autocast), mb.response_ids,
                                       u.temperature, u.chunk_size)
        kl = kl_penalty(logp, ref_logp, u.algo.kl_type)  # [b, T]
        metrics["actor/kl_ref"] = masked_mean(kl.detach(), mb.mask)
        loss = loss + u.algo.kl_coef * aggregate(kl, mb.mask, agg, global_tokens, u.world)
    if agg != "token-mean":
        loss = loss * seq_scale  # seq-mean modes average over the micro-batch: rescale to the mini-batch
    metrics["actor/loss"] = loss.detach()
    return loss, metrics


def _step(u: Updater) -> tuple[Tensor, bool]:
    """Clip the gradient norm and step; skip (zero grads) when the norm is not finite. Returns (norm, stepped)."""
    params = [p for p in u.model.parameters() if p.grad is not None]
    max_norm = u.optim.grad_clip if u.optim.grad_clip is not None else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    stepped = bool(torch.isfinite(norm))  # one sync per optimizer step; grads are already all-reduced
    if stepped:
        u.optimizer.step()
    else:
        log.warning("non-finite gradient norm (%s): optimizer step skipped", norm.item())
    u.optimizer.zero_grad(set_to_none=True)
    u.scheduler.step()
    return norm.detach(), stepped


def train_on_batch(u: Updater, b: RolloutBatch, generator: torch.Generator) -> dict[str, float]:
    """Advantages, optional dynamic sampling and recompute, then N = algo.staleness mini-batch updates."""
    b, b_adv, batch_metrics = batch_advantages(b, u.algo)
    if b.size < u.algo.staleness:
        log.warning("only %d sequences left after dynamic sampling: no update this step", b.size)
        return _summarise([batch_metrics], skipped=0, updates=0)
    micro = u.optim.micro_batch_size or b.size
    if u.algo.behaviour == "recompute":
        b = recompute_behaviour(u.model, b, k=u.algo.topk, temperature=u.temperature, chunk_size=u.chunk_size,
                                autocast=u.autocast, micro=micro)
    all_metrics: list[Metrics] = [batch_metrics]
    skipped = 0
    perm = torch.randperm(b.size, generator=generator, device=generator.device).cpu()
    for mb_idx in perm.tensor_split(u.algo.staleness):  # N mini-batches, one optimizer step each
        mb, mb_adv = b.select(mb_idx), b_adv[mb_idx]
        global_tokens = float(mb.mask.sum())  # every rank holds the whole mini-batch: a global count, no collective
        shard, shard_adv = rank_shard(mb, mb_adv, u.rank, u.world)
        pieces = torch.arange(shard.size).split(micro)
        for i, idx in enumerate(pieces):
            with no_grad_sync(u.model, enabled=i < len(pieces) - 1):
                loss, metrics = _micro_loss(u, shard.select(idx), shard_adv[idx], global_tokens=global_tokens,
                                            seq_scale=idx.numel() * u.world / mb.size, generator=generator)
                loss.backward()
            all_metrics.append(metrics)
        norm, stepped = _step(u)
        skipped += int(not stepped)
        all_metrics.append({"actor/grad_norm": norm, "actor/lr": torch.tensor(u.scheduler.get_last_lr()[0])})
    return _summarise(all_metrics, skipped=skipped, updates=u.algo.staleness)


def _summarise(parts: list[Metrics], *, skipped: int, updates: int) -> dict[str, float]:
    """Average each metric over the micro-batches that report it (min/max keys take min/max): one sync."""
    grouped: dict[str, list[Tensor]] = defaultdict(list)
    for part in parts:
        for key, value in part.items():
            grouped[key].append(value.detach().float().reshape(()).cpu())
    out: dict[str, float] = {}
    for key, values in grouped.items():
        stacked = torch.stack(values)
        if key.endswith("_min"):
            out[key] = float(stacked.min())
        elif key.endswith("_max"):
            out[key] = float(stacked.max())
        else:
            out[key] = float(stacked.mean())
    out["guard/skipped_updates"] = float(skipped)
    out["actor/updates"] = float(updates)
    return out
