"""One rollout batch -> advantages -> (dynamic sampling) -> N mini-batch policy updates.

Reads top to bottom (`train_on_batch`): GRPO advantages by group id, optional DAPO filter, optional recompute of
q, then for each of the N mini-batches: forward, log-probs from sis.py, the ratio from losses.compute_log_ratio,
the registered policy loss, backward, guard, step. No formula lives here; they are in sis.py, losses.py and
advantages.py. Distributed: every rank holds the whole batch; rank r trains on rows r::world of each mini-batch.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from sisrl.common.tensors import masked_mean
from sisrl.common.wire import SIS_ACCEPTED, SIS_NOT_POLICY, SIS_OUTSIDE, SIS_REJECTED
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
from sisrl.trainer.policy import no_grad_sync, policy_logits
from sisrl.trainer.sis import (
    SISResult,
    behaviour_topk,
    exact_log_m,
    gather_logprobs,
    ratio_metrics,
    sis_log_ratio,
    token_and_topk_logprobs,
    token_in_topk,
    topk_in_support,
)
from torch import Tensor, nn

log = logging.getLogger(__name__)
Metrics = dict[str, Tensor]


@dataclass(frozen=True)
class TokenRecord:
    """One trajectory's per-token outcome of its update pass, in the response's own columns ([T] each).

    status: common.wire SIS_* codes (accepted / rejected / outside V_K / not a policy token); with a ratio
    other than 'sis' it is the would-be decision of the same test, which that loss does not use."""

    row: int  # row of the rollout batch as collated (before dynamic sampling)
    status: Tensor  # int8
    ratio: Tensor  # r_t the loss used (0 at non-policy tokens)
    logp: Tensor  # log pi(y_t) at that pass
    log_m: Tensor  # log M_t
    advantage: float


def token_records(mb: RolloutBatch, rows: Tensor, adv: Tensor, *, logp: Tensor, log_ratio: Tensor, sis: SISResult,
                  in_topk: Tensor, width: int) -> list[TokenRecord]:
    """TokenRecords of a micro-batch; a compacted view is scattered back to the padded response width."""
    with torch.no_grad():
        policy = mb.mask.bool()
        has_vk = topk_in_support(mb.topk_logq).any(dim=-1)
        status = torch.full(policy.shape, SIS_NOT_POLICY, dtype=torch.int8, device=policy.device)
        status[policy] = SIS_REJECTED
        status[policy & ~(in_topk.bool() & has_vk)] = SIS_OUTSIDE
        status[sis.accepted & policy] = SIS_ACCEPTED
        fields = {"status": status, "ratio": torch.where(policy, log_ratio.detach().exp(), 0.0),
                  "logp": torch.where(policy, logp.detach(), 0.0), "log_m": torch.where(policy, sis.log_m, 0.0)}
        if mb.positions is not None:  # back to the response's own columns
            for key, value in fields.items():
                fill = SIS_NOT_POLICY if key == "status" else 0
                full = torch.full((value.shape[0], width), fill, dtype=value.dtype, device=value.device)
                fields[key] = full.scatter(1, mb.positions, value)
        cpu = {key: value.cpu() for key, value in fields.items()}
        return [TokenRecord(row=int(r), status=cpu["status"][i], ratio=cpu["ratio"][i], logp=cpu["logp"][i],
                            log_m=cpu["log_m"][i], advantage=float(adv[i])) for i, r in enumerate(rows.tolist())]


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
    compact_logits: bool = False  # lm_head and [.., V] passes only at policy tokens (policy.policy_logits)
    shared_prefix: bool = False  # the prompt tokens all rows share run once (policy.prefix_inputs)
    rank: int = 0
    world: int = 1
    behaviour_model: nn.Module | None = None  # exact SIS: a copy of the weights that sampled the current batch

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


def batch_advantages(b: RolloutBatch, algo: AlgorithmConfig) -> tuple[RolloutBatch, Tensor, Metrics, Tensor]:
    """GRPO advantages [B] by group id, then (DAPO) drop groups whose rewards are all equal. Also returns the
    rows of `b` that were kept ([B'] long, on the CPU)."""
    rows = torch.arange(b.size)
    b_adv = grpo_advantages(b.rewards, b.group_ids, norm_by_std=algo.norm_adv_by_std)
    if algo.flip_advantage_sign:
        b_adv = -b_adv
    metrics: Metrics = {"rollout/kept_frac": torch.ones(())}
    if algo.dynamic_sampling:
        keep = dynamic_sampling_mask(b.rewards, b.group_ids)
        metrics["rollout/kept_frac"] = keep.float().mean()
        idx = keep.nonzero().squeeze(-1)
        b, b_adv = b.select(idx), b_adv[idx]
        rows = rows[idx.cpu()]
    return b, b_adv, metrics, rows


@torch.no_grad()
def recompute_behaviour(model: nn.Module, b: RolloutBatch, *, k: int, temperature: float,
                        chunk_size: int | None, autocast: bool, micro: int, compact: bool = True,
                        shared_prefix: bool = True) -> RolloutBatch:
    """`recompute` q: a no-grad forward of the rollout weights (call before any update of this batch). With
    `compact` the forward is the update's own (`policy_logits`: the head and the [.., V] passes at the policy's
    tokens only, no [b, T, V]); q is written back to those tokens' response columns, zeros elsewhere (mask 0)."""
    logq = torch.zeros_like(b.logq)
    topk_ids = torch.zeros((*b.logq.shape, k), dtype=torch.long, device=b.logq.device)
    topk_logq = torch.zeros((*b.logq.shape, k), dtype=b.logq.dtype, device=b.logq.device)
    for idx in torch.arange(b.size).split(micro):
        mb = b.select(idx)
        logits, view = policy_logits(model, mb, autocast=autocast, compact=compact, shared_prefix=shared_prefix)
        lq, ids, lps = behaviour_topk(logits, view.response_ids, k, temperature, chunk_size)
        del logits
        if view.positions is None:
            logq[idx], topk_ids[idx], topk_logq[idx] = lq.to(logq.dtype), ids, lps.to(topk_logq.dtype)
            continue
        keep = view.mask > 0  # [b, T'] slots past a row's policy tokens hold other columns: left at zero
        cols = view.positions
        by_k = cols.unsqueeze(-1).expand(-1, -1, k)
        logq[idx] = torch.zeros_like(mb.logq).scatter_(1, cols, torch.where(keep, lq, 0.0).to(logq.dtype))
        topk_ids[idx] = torch.zeros_like(topk_ids[idx]).scatter_(1, by_k, ids * keep.unsqueeze(-1))
        topk_logq[idx] = torch.zeros_like(topk_logq[idx]).scatter_(
            1, by_k, torch.where(keep.unsqueeze(-1), lps, 0.0).to(topk_logq.dtype))
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
                generator: torch.Generator, rows: Tensor | None = None) -> tuple[Tensor, Metrics, list[TokenRecord]]:
    """Loss of one micro-batch (scaled so that summing micro-batches and DDP-averaging ranks gives the
    mini-batch loss), its detached metrics, and its TokenRecords when `rows` (batch rows of mb) is given."""
    padded = mb
    logits, mb = policy_logits(u.model, mb, autocast=u.autocast, compact=u.compact_logits,
                               shared_prefix=u.shared_prefix)  # [b, T', V]
    logp, topk_logp = token_and_topk_logprobs(logits, mb.response_ids, mb.topk_ids, u.temperature, u.chunk_size)
    in_topk = token_in_topk(mb.response_ids, mb.topk_ids)  # [b, T]
    log_m = None
    if u.behaviour_model is not None:  # exact SIS: q over the whole vocabulary from the sampling weights
        with torch.no_grad():
            logits_q, _ = policy_logits(u.behaviour_model, padded, autocast=u.autocast, compact=u.compact_logits,
                                        shared_prefix=u.shared_prefix)
        log_m = exact_log_m(logits, logits_q, u.temperature, u.chunk_size)
        del logits_q
        in_topk = torch.ones_like(in_topk)
    ratio = compute_log_ratio(
        u.algo.ratio, logp=logp, logq=mb.logq, mask=mb.mask, topk_logp=topk_logp, topk_logq=mb.topk_logq,
        in_topk=in_topk, generator=generator, tis_cap=u.algo.tis_cap, icepop_low=u.algo.icepop_low,
        icepop_high=u.algo.icepop_high, seqmask_mode=u.algo.seqmask_mode, seqmask_low=u.algo.seqmask_low,
        seqmask_high=u.algo.seqmask_high, log_m=log_m,
    )
    loss_fn = get_policy_loss(u.algo.loss)
    loss, metrics = loss_fn(log_ratio=ratio.log_ratio, advantages=mb_adv, mask=mb.mask, weights=ratio.weights,
                            global_tokens=global_tokens, dp_size=u.world, **u.loss_kwargs())  # type: ignore[arg-type]
    metrics.update(ratio.metrics)
    sis = ratio.sis
    if sis is None:
        # D, D_SIS and the would-be accept rate as diagnostics: same test, not used by this loss.
        sis = sis_log_ratio(logp=logp.detach(), logq=mb.logq, topk_logp=topk_logp, topk_logq=mb.topk_logq,
                            in_topk=in_topk, mask=mb.mask, generator=generator, log_m=log_m)
        metrics.update(sis.metrics)
        metrics.update(ratio_metrics(ratio.log_ratio, mb.mask.bool()))  # the ratio this loss used, not SIS's
    records = [] if rows is None else token_records(mb, rows, mb_adv, logp=logp, log_ratio=ratio.log_ratio, sis=sis,
                                                    in_topk=in_topk, width=padded.response_len)
    agg = u.agg_mode()
    with torch.set_grad_enabled(u.algo.entropy_coef > 0):
        entropy = entropy_from_logits(logits, u.chunk_size)  # [b, T]
    metrics["actor/entropy"] = masked_mean(entropy.detach(), mb.mask)
    if u.algo.entropy_coef > 0:
        loss = loss - u.algo.entropy_coef * aggregate(entropy, mb.mask, agg, global_tokens, u.world)
    if u.ref_model is not None and u.algo.kl_coef > 0:
        with torch.no_grad():
            # the policy's layout, whatever the reference's own would be (a policy whose forward takes no
            # `logits_to_keep` falls back to the full layout), so that the two line up token by token. Under FSDP2
            # the reference is sharded like the policy (distributed.wrap_reference)
            compact = u.compact_logits and mb is not padded
            ref_logits, _ = policy_logits(u.ref_model, padded, autocast=u.autocast, compact=compact,
                                          shared_prefix=u.shared_prefix)
            ref_logp = gather_logprobs(ref_logits, mb.response_ids, u.temperature, u.chunk_size)
        kl = kl_penalty(logp, ref_logp, u.algo.kl_type)  # [b, T]
        metrics["actor/kl_ref"] = masked_mean(kl.detach(), mb.mask)
        loss = loss + u.algo.kl_coef * aggregate(kl, mb.mask, agg, global_tokens, u.world)
    if agg != "token-mean":
        loss = loss * seq_scale  # seq-mean modes average over the micro-batch: rescale to the mini-batch
    metrics["actor/loss"] = loss.detach()
    return loss, metrics, records


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


def train_on_batch(u: Updater, b: RolloutBatch, generator: torch.Generator,
                   records: list[TokenRecord] | None = None) -> dict[str, float]:
    """Advantages, optional dynamic sampling and recompute, then N = algo.staleness mini-batch updates.
    `records`: a list that receives each trained row's TokenRecord (single process only; under torchrun a
    rank sees only its shard, so nothing is recorded there)."""
    b, b_adv, batch_metrics, rows = batch_advantages(b, u.algo)
    record = records is not None and u.world == 1
    if b.size < u.algo.staleness:
        log.warning("only %d sequences left after dynamic sampling: no update this step", b.size)
        return _summarise([batch_metrics], skipped=0, updates=0)
    micro = u.optim.micro_batch_size or b.size
    if u.algo.behaviour == "recompute":
        b = recompute_behaviour(u.model, b, k=u.algo.logprobs_k, temperature=u.temperature, chunk_size=u.chunk_size,
                                autocast=u.autocast, micro=micro, compact=u.compact_logits,
                                shared_prefix=u.shared_prefix)
    if u.algo.sis_exact:
        if u.world > 1:
            raise ValueError("algorithm.sis_exact=true runs in one process only (it keeps a full copy of the "
                             f"sampling weights); this run has {u.world} ranks")
        u.behaviour_model = copy.deepcopy(u.model).requires_grad_(False)
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
                loss, metrics, recs = _micro_loss(u, shard.select(idx), shard_adv[idx], global_tokens=global_tokens,
                                                  seq_scale=idx.numel() * u.world / mb.size, generator=generator,
                                                  rows=rows[mb_idx][idx] if record else None)
                loss.backward()
            all_metrics.append(metrics)
            if records is not None:
                records.extend(recs)
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
