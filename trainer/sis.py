"""Selective Importance Sampling (SIS): the token-level accept/reject test, in pure torch.

Source: "Turning Off-Policy Tokens On-Policy: A Plug-in Approach for Improving LLM Alignment" (arXiv 2607.04728).
Notation (docs/design.md, "Selective Importance Sampling"): q behaviour policy, pi target policy, y_t sampled
token, l_t = log pi(y_t) - log q(y_t).
Shapes: B batch, T response time steps, V vocabulary, K behaviour top-K. No I/O, no config, no `.item()`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from sisrl.common.tensors import masked_mean
from torch import Tensor


def gather_logprobs(logits: Tensor, ids: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """Log-probs of `ids` under softmax(logits / temperature), without a second [B, T, V] tensor.

    logits: [B, T, V]; ids: [B, T] or [B, T, K] -> [B, T] or [B, T, K], float32.
    Naive equivalent: `torch.log_softmax(logits / temperature, -1).gather(-1, ids)`; here only the gathered entries
    and the [B, T] logsumexp are formed (logit - logsumexp), chunked over time when `chunk_size` is given.
    For the backward only the logits themselves and the [B, T] logsumexp are kept (`_GatherLogprobs`): autograd
    through the chunks would keep each chunk's float32 copy (bf16 logits, or any temperature but 1), that is a
    whole [B, T, V] float32 tensor by the end of the loop.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    squeeze = ids.dim() == logits.dim() - 1
    idx = ids.unsqueeze(-1) if squeeze else ids
    step = chunk_size or logits.shape[1]
    res = _GatherLogprobs.apply(logits, idx, temperature, step)
    return res.squeeze(-1) if squeeze else res


class _GatherLogprobs(torch.autograd.Function):
    """`gather_logprobs` with a backward that recomputes softmax chunk by chunk (no [B, T, V] float32 kept).

    out_j = x_{i_j} / tau - logsumexp(x / tau), so d out_j / d x_v = (1[v = i_j] - p_v) / tau, and the gradient
    of the logits is (scatter_add(g) - p * sum_j g_j) / tau, p = softmax(x / tau), per chunk of positions."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, idx: Tensor, temperature: float, step: int) -> Tensor:
        out, lse = [], []
        for s in range(0, logits.shape[1], step):
            chunk = logits[:, s : s + step].float()
            if temperature != 1.0:
                chunk = chunk / temperature  # the sampler's processed distribution (vLLM processed_logprobs)
            lse.append(torch.logsumexp(chunk, dim=-1, keepdim=True))  # [B, t, 1]
            out.append(chunk.gather(-1, idx[:, s : s + step]) - lse[-1])
        ctx.save_for_backward(logits, idx, torch.cat(lse, dim=1))
        ctx.temperature, ctx.step = temperature, step
        return torch.cat(out, dim=1)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        logits, idx, lse = ctx.saved_tensors
        grad, tau, step = grads[0], ctx.temperature, ctx.step
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[1], step):
            g = grad[:, s : s + step].float()  # [B, t, n]
            p = torch.exp(logits[:, s : s + step].float() / tau - lse[:, s : s + step])  # [B, t, V]
            d = (p * -g.sum(dim=-1, keepdim=True)).scatter_add_(-1, idx[:, s : s + step], g)
            out[:, s : s + step] = d / tau if tau != 1.0 else d
        return out, None, None, None


def token_and_topk_logprobs(
    logits: Tensor, token_ids: Tensor, topk_ids: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """Current log-probs of the sampled tokens (with grad) and at the behaviour top-K ids (no grad).

    logits [B, T, V], token_ids [B, T], topk_ids [B, T, K] -> (logp [B, T], topk_logp [B, T, K]).
    One gather of 1 + K columns per position shares the logsumexp, so SIS costs K extra floats per token.
    """
    ids = torch.cat([token_ids.unsqueeze(-1), topk_ids], dim=-1)  # [B, T, 1 + K]
    both = gather_logprobs(logits, ids, temperature, chunk_size)
    # M_t is computed without gradient (docs/design.md), so the top-K part is detached.
    return both[..., 0], both[..., 1:].detach()


@torch.no_grad()
def behaviour_topk(
    logits: Tensor, token_ids: Tensor, k: int, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """`recompute` source of q: log q(y_t) and q's top-K from a no-grad forward of the behaviour weights.

    logits [B, T, V], token_ids [B, T] -> (logq [B, T], topk_ids [B, T, K] int64, topk_logq [B, T, K]).
    K = V gives the exact (full-vocabulary) mode.
    """
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [1, {logits.shape[-1]}] (the vocabulary size), got {k}")
    step = chunk_size or logits.shape[1]
    topk_ids = torch.cat([logits[:, s : s + step].topk(k, dim=-1).indices for s in range(0, logits.shape[1], step)], 1)
    logq, topk_logq = token_and_topk_logprobs(logits, token_ids, topk_ids, temperature, chunk_size)
    return logq, topk_ids, topk_logq


def token_in_topk(token_ids: Tensor, topk_ids: Tensor) -> Tensor:
    """[B, T] bool: whether y_t is among q's top-K ids at t (token_ids [B, T], topk_ids [B, T, K])."""
    return (topk_ids == token_ids.unsqueeze(-1)).any(dim=-1)


# Log-probs at or below this are q(v) = 0: exp(-1000) underflows even in float64. Engines record absent top-K
# entries (top-p nucleus smaller than K) as vLLM's floor -9999 or as -inf; they are outside V_K.
MIN_SUPPORT_LOGPROB = -1000.0


def topk_in_support(topk_logq: Tensor) -> Tensor:
    """[B, T, K] bool: top-K entries with 0 < q(v) <= 1; the others (-inf, floors, +inf) are padding, not V_K."""
    return (topk_logq > MIN_SUPPORT_LOGPROB) & torch.isfinite(topk_logq)


class SISResult(NamedTuple):
    """Output of `sis_log_ratio`; every tensor is [B, T] and zero/False at masked positions."""

    log_ratio: Tensor  # log r_t: logp - sg(logp) where accepted (value 0, on-policy grad), logp - logq elsewhere
    accepted: Tensor  # bool
    log_m: Tensor  # log M_t = max_{v in V_K} log pi(v) - log q(v), no grad
    metrics: dict[str, Tensor]  # detached scalars, see `sis_metrics`


def sis_log_ratio(
    *,
    logp: Tensor,
    logq: Tensor,
    topk_logp: Tensor,
    topk_logq: Tensor,
    in_topk: Tensor,
    mask: Tensor,
    generator: torch.Generator | None = None,
    log_m: Tensor | None = None,
) -> SISResult:
    """The SIS acceptance test and the per-token log-ratio to put inside any policy loss.

    logp [B, T] current log pi(y_t) (with grad); logq [B, T] behaviour log q(y_t); topk_logp, topk_logq [B, T, K]
    log pi and log q at q's top-K ids; in_topk [B, T] bool; mask [B, T] (1 = policy token); generator seeds u.
    Formulas (docs/design.md, "Selective Importance Sampling"): M_t = max_{v in V_K} pi(v)/q(v); accept iff
    y_t in V_K and u <= w_t / M_t, u ~ U(0,1), w_t = exp(l_t). Accepted: r_t = exp(logp - sg(logp)); rejected:
    r_t = exp(logp - logq).
    `log_m` [B, T]: exact SIS (V_K = the whole vocabulary, `exact_log_m`); then every sampled token is in V_K,
    the top-K inputs are ignored and xi_K is 0.
    """
    valid = mask.bool()
    log_w = (logp - logq).detach()  # l_t
    if log_m is not None:
        in_support = torch.ones(*logp.shape, 1, dtype=torch.bool, device=logp.device)
        topk_logp = torch.zeros(*logp.shape, 1, device=logp.device)  # pi summed over V is 1: xi = 0
        in_topk = torch.ones_like(valid)
        log_m = log_m.detach()
    else:
        in_support = topk_in_support(topk_logq)  # [B, T, K]
        log_m = torch.where(in_support, (topk_logp - topk_logq).detach(), -torch.inf).amax(dim=-1)  # [B, T]
    has_vk = in_support.any(dim=-1)  # [B, T]
    # One uniform per position, masked or not, so the random stream depends only on the shape.
    u = torch.rand(logp.shape, generator=generator, device=logp.device, dtype=torch.float32)
    # u <= w/M  <=>  log u <= l - log M; computed in log space so huge ratios cannot overflow.
    accepted = valid & in_topk.bool() & has_vk & (torch.log(u) <= (log_w - log_m))
    on_policy = logp - logp.detach()
    log_ratio = torch.where(accepted, on_policy, logp - logq)
    log_ratio = torch.where(valid, log_ratio, on_policy)  # masked: value 0, and the loss mask zeroes its grad
    log_m = torch.where(valid & has_vk, log_m, torch.zeros_like(log_m))
    topk_p = torch.where(in_support, topk_logp.detach().exp(), torch.zeros_like(topk_logp))
    metrics = sis_metrics(log_w=log_w, accepted=accepted, topk_p=topk_p, log_ratio=log_ratio, mask=valid)
    return SISResult(log_ratio, accepted, log_m, metrics)


@torch.no_grad()
def exact_log_m(logits_p: Tensor, logits_q: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """log M_t = max over the whole vocabulary of log pi(v) - log q(v) (exact SIS, K = V), chunked over time.

    logits_p, logits_q [B, T, V] -> [B, T]. Entries where q(v) underflows (log q <= MIN_SUPPORT_LOGPROB) are not in
    q's support and count nowhere."""
    step = chunk_size or logits_p.shape[1]
    out = []
    for s in range(0, logits_p.shape[1], step):
        lp = torch.log_softmax(logits_p[:, s : s + step].float() / temperature, dim=-1)
        lq = torch.log_softmax(logits_q[:, s : s + step].float() / temperature, dim=-1)
        out.append(torch.where(lq > MIN_SUPPORT_LOGPROB, lp - lq, -torch.inf).amax(dim=-1))
    return torch.cat(out, dim=1)


def sis_metrics(*, log_w: Tensor, accepted: Tensor, topk_p: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-batch SIS diagnostics over unmasked tokens only (all inputs [B, T] except topk_p = pi on V_K [B, T, K]).

    sis/accept_rate   accepted tokens / policy tokens
    sis/D             mean over sequences of sum_t |l_t|            (log-importance deviation)
    sis/D_sis         mean over sequences of sum_{t rejected} |l_t| (<= sis/D pathwise)
    sis/xi_k          mean over tokens of 1 - sum_{v in V_K} pi(v)  (residual mass outside q's top-K)
    sis/ratio_*       min / mean / max of the ratio r_t used in the loss
    sis/kl_k1, kl_k3  estimates of KL(q || pi) from samples of q: mean(-l_t), mean(w_t - 1 - l_t)
    """
    with torch.no_grad():
        zero = torch.zeros_like(log_w)
        abs_l = torch.where(mask, log_w.abs(), zero)
        rows = mask.any(dim=-1).sum().clamp(min=1)
        xi = 1.0 - topk_p.sum(dim=-1)
        w = log_w.clamp(max=50.0).exp()  # clamp: an exp overflow must not turn the KL estimate into inf
        return {
            "sis/accept_rate": masked_mean(accepted.float(), mask),
            "sis/D": abs_l.sum() / rows,
            "sis/D_sis": torch.where(accepted, zero, abs_l).sum() / rows,
            "sis/xi_k": masked_mean(xi.clamp(min=0.0), mask),
            **ratio_metrics(log_ratio, mask),
            "sis/kl_k1": masked_mean(-log_w, mask),
            "sis/kl_k3": masked_mean(w - 1.0 - log_w, mask),
        }


def ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """`sis/ratio_min|mean|max|ess` of r_t = exp(log_ratio) over unmasked tokens ([B, T] each; 0 when none).

    Called with the ratio the loss uses, whatever the strategy (is / sis / tis / icepop), so an IS ratio that
    blows up at large staleness shows here.
    """
    with torch.no_grad():
        ratio = log_ratio.detach().exp()
        has = mask.any()
        inf = torch.full_like(ratio, float("inf"))
        return {
            "sis/ratio_min": torch.where(has, torch.where(mask, ratio, inf).amin(), ratio.new_zeros(())),
            "sis/ratio_mean": masked_mean(ratio, mask),
            "sis/ratio_max": torch.where(has, torch.where(mask, ratio, -inf).amax(), ratio.new_zeros(())),
            # Kish's effective sample size of the token ratios as a share of the tokens: (sum r)^2 / (n sum r^2)
            "sis/ratio_ess": masked_mean(ratio, mask) ** 2 / masked_mean(ratio * ratio, mask).clamp(min=1e-30),
        }
