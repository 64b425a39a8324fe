"""Policy losses with a pluggable importance ratio: none, plain IS, SIS, TIS, IcePop and seqmask share one loss code path.

A ratio strategy turns (log pi, log q, ...) into a per-token log-ratio [B, T] and optional per-token weights;
a policy loss turns that log-ratio and the advantages into a scalar. SIS enters only as the ratio.
Shapes: B sequences, T response tokens, K behaviour top-K, V vocabulary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from sisrl.common.tensors import masked_mean
from sisrl.trainer.sis import SISResult, sis_log_ratio
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
Metrics = dict[str, Tensor]


class RatioResult(NamedTuple):
    log_ratio: Tensor  # [B, T] log r_t used inside the loss
    weights: Tensor | None  # [B, T] per-token multipliers (IcePop's 0/1 mask), None when unused
    metrics: Metrics
    sis: SISResult | None = None  # the accept test's per-token outcome (strategy 'sis' only)


class PolicyLoss(Protocol):
    def __call__(
        self,
        *,
        log_ratio: Tensor,
        advantages: Tensor,
        mask: Tensor,
        agg_mode: str = "token-mean",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        clip_dual: float | None = None,
        weights: Tensor | None = None,
        global_tokens: float | None = None,
        dp_size: int = 1,
    ) -> tuple[Tensor, Metrics]: ...


RATIO_STRATEGIES = ("none", "is", "sis", "tis", "icepop", "seqmask")
_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a loss under `name`; a taken name is refused."""

    def deco(fn: PolicyLoss) -> PolicyLoss:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in _POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(_POLICY_LOSSES)}")
    return _POLICY_LOSSES[name]


def compute_log_ratio(
    strategy: str,
    *,
    logp: Tensor,
    logq: Tensor,
    mask: Tensor,
    topk_logp: Tensor | None = None,
    topk_logq: Tensor | None = None,
    in_topk: Tensor | None = None,
    generator: torch.Generator | None = None,
    tis_cap: float = 2.0,
    icepop_low: float = 0.5,
    icepop_high: float = 2.0,
    seqmask_mode: str = "sequence",
    seqmask_low: float | None = None,
    seqmask_high: float = 2.0,
    log_m: Tensor | None = None,
) -> RatioResult:
    """The per-token log-ratio for `strategy` (logp, logq, mask [B, T]; top-K inputs [B, T, K] for SIS).

    is:     log r = l_t = logp - logq
    sis:    `sis.sis_log_ratio` (accepted tokens on-policy; `log_m` given: exact SIS over the whole vocabulary)
    tis:    r = min(w, C) in value with gradient C * grad log pi above the cap: log r = l - sg(relu(l - log C))
    icepop: r = w, and tokens with w outside [low, high] get weight 0 (no gradient, still counted in the mean)
    none:   r = exp(logp - sg(logp)): value 1, the on-policy gradient; stale tokens used as if on-policy
    seqmask: r = w, and every token of a sequence whose ratio is outside [low, high] gets weight 0; the sequence
            ratio is prod_t w_t (mode "sequence") or its geometric mean exp(mean_t l_t) ("geometric"); low
            defaults to 1 / high. verl's rollout rejection sampling (`rollout_rs`, whose default bounds these are).
    """
    valid = mask.bool()
    log_w = logp - logq
    if strategy == "sis":
        if topk_logp is None or topk_logq is None or in_topk is None:
            raise ValueError("ratio strategy 'sis' needs topk_logp, topk_logq and in_topk")
        res = sis_log_ratio(
            logp=logp, logq=logq, topk_logp=topk_logp, topk_logq=topk_logq, in_topk=in_topk, mask=mask,
            generator=generator, log_m=log_m,
        )
        return RatioResult(res.log_ratio, None, res.metrics, res)
    if strategy == "is":
        return RatioResult(log_w, None, {})
    if strategy == "none":
        return RatioResult(logp - logp.detach(), None, {})
    if strategy == "seqmask":
        low = 1.0 / seqmask_high if seqmask_low is None else seqmask_low
        if not 0 <= low < seqmask_high:
            raise ValueError(f"seqmask bounds need 0 <= low < high, got low={low}, high={seqmask_high}")
        if seqmask_mode not in ("sequence", "geometric"):
            raise ValueError(f"seqmask_mode must be 'sequence' or 'geometric', got {seqmask_mode!r}")
        seq_log = torch.where(valid, log_w.detach(), 0.0).sum(dim=-1)  # [B]
        if seqmask_mode == "geometric":
            seq_log = seq_log / valid.sum(dim=-1).clamp(min=1)
        keep_seq = (seq_log >= (math.log(low) if low > 0 else -math.inf)) & (seq_log <= math.log(seqmask_high))
        keep = keep_seq.unsqueeze(-1).expand_as(log_w).to(log_w.dtype)
        rows = valid.any(dim=-1)
        masked_seqs = (~keep_seq & rows).sum() / rows.sum().clamp(min=1)
        return RatioResult(log_w, keep, {"seqmask/masked_frac": masked_mean(1.0 - keep, valid),
                                         "seqmask/masked_seq_frac": masked_seqs.float()})
    if strategy == "tis":
        if tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
        excess = torch.relu(log_w.detach() - torch.log(torch.tensor(tis_cap)))
        return RatioResult(log_w - excess, None, {"tis/truncated_frac": masked_mean((excess > 0).float(), valid)})
    if strategy == "icepop":
        if not 0 <= icepop_low < icepop_high:
            raise ValueError(f"icepop bounds need 0 <= low < high, got low={icepop_low}, high={icepop_high}")
        w = log_w.detach().exp()
        keep = ((w >= icepop_low) & (w <= icepop_high)).float()
        return RatioResult(log_w, keep, {"icepop/masked_frac": masked_mean(1.0 - keep, valid)})
    raise ValueError(f"unknown ratio strategy {strategy!r}; valid: {list(RATIO_STRATEGIES)}")


def aggregate(
    loss_mat: Tensor, mask: Tensor, mode: str, global_tokens: float | None = None, dp_size: int = 1
) -> Tensor:
    """Reduce per-token losses [B, T] to a scalar; masked tokens count nowhere.

    token-mean:              sum_{b,t} m l / N_tokens          (N_tokens global across ranks when given)
    seq-mean-token-mean:     mean_b (sum_t m l / sum_t m)
    seq-mean-token-sum:      mean_b sum_t m l
    seq-mean-token-sum-norm: mean_b sum_t m l / T              (T = padded length; Dr. GRPO's constant)
    With `global_tokens` (all ranks' tokens), token-mean is scaled by `dp_size` so that DDP's gradient average
    equals the global token mean.
    """
    m = mask.to(loss_mat.dtype)
    masked = torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat))
    if mode == "token-mean":
        if global_tokens is None:
            return masked.sum() / m.sum().clamp(min=1)
        return masked.sum() * dp_size / max(global_tokens, 1.0)
    seq_sum = masked.sum(dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        return (seq_sum / m.sum(dim=-1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-sum-norm":
        return seq_sum.mean() / loss_mat.shape[-1]
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {list(AGG_MODES)}")


def _per_token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1).expand_as(like)  # [B] -> [B, T]
    if advantages.shape != like.shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} must be [B] or {tuple(like.shape)}")
    return advantages


def _clipped_objective(
    ratio: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float, clip_dual: float | None
) -> tuple[Tensor, Metrics]:
    """PPO clip: l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); dual clip: min(l, -A c) where A < 0."""
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if clip_dual is not None:
        if clip_dual <= 1.0:
            raise ValueError(f"clip_dual must be > 1, got {clip_dual}")
        dual = torch.minimum(loss, -adv * clip_dual)
        loss = torch.where(adv < 0, dual, loss)
        clipped = clipped | ((adv < 0) & (dual < torch.maximum(pg1, pg2)))
    valid = mask.bool()
    return loss, {"loss/clipfrac": masked_mean(clipped.float(), valid).detach()}


def _finish(loss_mat: Tensor, mask: Tensor, agg_mode: str, weights: Tensor | None,
            global_tokens: float | None, dp_size: int, metrics: Metrics) -> tuple[Tensor, Metrics]:
    if weights is not None:
        loss_mat = loss_mat * weights
    loss = aggregate(loss_mat, mask, agg_mode, global_tokens, dp_size)
    metrics["loss/policy"] = loss.detach()
    return loss, metrics


@register_policy_loss("grpo")
def grpo_loss(
    *, log_ratio: Tensor, advantages: Tensor, mask: Tensor, agg_mode: str = "token-mean", clip_low: float = 0.2,
    clip_high: float = 0.2, clip_dual: float | None = None, weights: Tensor | None = None,
    global_tokens: float | None = None, dp_size: int = 1,
) -> tuple[Tensor, Metrics]:
    """PPO/GRPO clipped surrogate on r_t = exp(log_ratio) [B, T]; advantages [B] or [B, T]."""
    adv = _per_token_advantages(advantages, log_ratio)
    loss_mat, metrics = _clipped_objective(log_ratio.exp(), adv, mask, clip_low, clip_high, clip_dual)
    return _finish(loss_mat, mask, agg_mode, weights, global_tokens, dp_size, metrics)


# DAPO: the clipped surrogate with clip-higher (eps_high 0.28 by default) and token-mean aggregation. Dynamic
# sampling (dropping groups whose rewards are all equal) happens before the loss: `dynamic_sampling_mask`.
dapo_loss = register_policy_loss("dapo")(functools.partial(grpo_loss, clip_high=0.28))


@register_policy_loss("grpo_noclip")
def grpo_noclip_loss(
    *, log_ratio: Tensor, advantages: Tensor, mask: Tensor, agg_mode: str = "token-mean", clip_low: float = 0.2,
    clip_high: float = 0.2, clip_dual: float | None = None, weights: Tensor | None = None,
    global_tokens: float | None = None, dp_size: int = 1,
) -> tuple[Tensor, Metrics]:
    """Clip-free surrogate -A r_t (the paper trains GRPO+SIS this way); clip arguments are not used."""
    adv = _per_token_advantages(advantages, log_ratio)
    metrics: Metrics = {"loss/clipfrac": torch.zeros((), device=log_ratio.device)}
    return _finish(-adv * log_ratio.exp(), mask, agg_mode, weights, global_tokens, dp_size, metrics)


@register_policy_loss("gspo")
def gspo_loss(
    *, log_ratio: Tensor, advantages: Tensor, mask: Tensor, agg_mode: str = "seq-mean-token-mean",
    clip_low: float = 3e-4, clip_high: float = 4e-4, clip_dual: float | None = None,
    weights: Tensor | None = None, global_tokens: float | None = None, dp_size: int = 1,
) -> tuple[Tensor, Metrics]:
    """GSPO: s_i = exp(mean_t log r_t); per token s_i,t = sg(s_i) * pi_t / sg(pi_t), clipped with a tiny range.

    With SIS log-ratios the accepted tokens contribute 0 to log s_i. `log_ratio - sg(log_ratio)` has value 0 and
    the gradient of log pi_t for every strategy, which is exactly pi_t / sg(pi_t) in log space.
    """
    m = mask.to(log_ratio.dtype)
    seq_log = (torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio)).sum(-1)
               / m.sum(-1).clamp(min=1))  # [B]
    tok_log_ratio = seq_log.detach().unsqueeze(-1) + log_ratio - log_ratio.detach()  # [B, T]
    adv = _per_token_advantages(advantages, log_ratio)
    loss_mat, metrics = _clipped_objective(tok_log_ratio.exp(), adv, mask, clip_low, clip_high, clip_dual)
    metrics["gspo/seq_ratio_mean"] = seq_log.detach().exp().mean()
    return _finish(loss_mat, mask, agg_mode, weights, global_tokens, dp_size, metrics)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || ref) estimators [B, T] from samples of pi (Schulman's k1, k2, k3).

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 ("low_var_kl") = exp(ref - logp) - (ref - logp) - 1, clamped.
    """
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        neg = (-diff).clamp(-20.0, 20.0)  # clamp before exp: verl bounds low_var_kl the same way
        return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL penalty {kind!r}; valid: ['k1', 'k2', 'k3', 'low_var_kl']")


def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Entropy of softmax(logits) per position: [B, T, V] -> [B, T], chunked over time to bound memory."""
    step = chunk_size or logits.shape[1]
    out = []
    for s in range(0, logits.shape[1], step):
        chunk = logits[:, s : s + step].float()
        logz = torch.logsumexp(chunk, dim=-1, keepdim=True)
        out.append(logz.squeeze(-1) - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
    return torch.cat(out, dim=1)
