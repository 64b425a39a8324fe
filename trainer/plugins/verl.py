"""SIS inside verl (written against verl 0.9.1): registered policy losses and the actor-side top-K extension.

Two pieces, both calling the SIS core (`sisrl.trainer.sis`, `sisrl.trainer.losses`), never re-implementing it:

1. Policy losses registered with verl's `register_policy_loss`: `sis` (the vanilla PPO/DAPO clipped form, dual
   clip `clip_ratio_c` as verl's `vanilla`) and `sis_gspo` (GSPO). They take verl's policy-loss signature
   `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)` and return
   `(scalar loss, metrics)`. Bypass semantics: `old_log_prob` must be the rollout (vLLM) log-probs, i.e. q.
   verl passes no top-K to a policy loss, so the SIS inputs arrive through `sis_tokens(...)`, a context set
   around the call.
2. `sis_actor_loss`: the actor loss function for verl's engine workers (`set_loss_fn`). verl's engine calls
   the loss function first as a logits processor on the (temperature-scaled, padding-removed) logits when the
   batch carries `distillation_use_topk=True`: there it gathers log pi at q's top-K ids (fused kernels must be
   off). Then, as the loss, it puts those top-K log-probs in the `sis_tokens` context and calls verl's own
   `ppo_loss`, so entropy, KL and metrics stay verl's. Batch keys it reads: `sis_topk_ids` and
   `sis_topk_logq`, [B, T, K] tensors (response-padded, like `rollout_log_probs`) or the per-sequence lists
   the rollout server puts in its `extra_fields` (`sisrl.trainer.plugins.verl_rollout`).

Import this module only where verl is installed; `import sisrl.trainer` never imports verl.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from sisrl.trainer.losses import compute_log_ratio, get_policy_loss
from sisrl.trainer.sis import gather_logprobs, token_in_topk
from torch import Tensor
from verl.trainer.ppo.core_algos import register_policy_loss
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

SIS_LOSS = "sis"
SIS_GSPO_LOSS = "sis_gspo"
# model_output keys, one per top-K rank (verl's engine keeps per-token scalars only)
TOPK_LOGP_KEY = "sis_topk_logp_{}"
_GATHER_CHUNK = 2048  # packed tokens per log-prob gather: bounds the float32 copy of [tokens, V] logits


@dataclass(frozen=True)
class SISTokens:
    """Per-micro-batch SIS inputs verl's policy-loss signature has no room for (response-padded)."""

    topk_logp: Tensor  # [B, T, K] log pi at q's top-K ids, no grad
    topk_logq: Tensor  # [B, T, K] log q at the same ids (rollout engine, `logprobs=K`)
    in_topk: Tensor  # [B, T] bool: the sampled token is among q's top-K


_CURRENT: ContextVar[SISTokens | None] = ContextVar("sisrl_verl_sis_tokens", default=None)
_GENERATORS: dict[torch.device, torch.Generator] = {}


@contextmanager
def sis_tokens(tokens: SISTokens) -> Iterator[None]:
    """Make `tokens` the SIS inputs of the policy-loss calls inside the block."""
    handle = _CURRENT.set(tokens)
    try:
        yield
    finally:
        _CURRENT.reset(handle)


def _generator(device: torch.device) -> torch.Generator:
    """One generator of the accept test's uniforms per device; seed $SISRL_SIS_SEED (default 0) + rank."""
    if device not in _GENERATORS:
        seed = int(os.environ.get("SISRL_SIS_SEED", "0")) + int(os.environ.get("RANK", "0"))
        _GENERATORS[device] = torch.Generator(device=device).manual_seed(seed)
    return _GENERATORS[device]


def _verl_aggregation(mode: str, mask: Tensor, info: dict[str, Any]) -> tuple[str, float | None, int, float]:
    """(our agg mode, global_tokens, dp_size, factor) so that factor * our loss equals verl's `agg_loss`.

    verl 0.9.1 `agg_loss` normalises by the global mini-batch (`config.global_batch_info`: dp_size,
    batch_num_tokens, global_batch_size, loss_scale_factor); our `aggregate` by the local micro-batch or by
    global tokens. token-mean maps directly; seq-mean-* differ by local rows * dp_size / global sequences.
    """
    dp = int(info.get("dp_size") or 1)
    tokens, seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    scale = info.get("loss_scale_factor")
    if mode == "token-mean":
        return "token-mean", (None if tokens is None else float(tokens)), dp, 1.0
    if mode == "token-sum":
        return "token-mean", None, 1, float(mask.sum()) * dp
    if mode not in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        raise ValueError(f"unknown loss_agg_mode {mode!r} for the SIS loss")
    rows = mask.shape[0]
    denominator = float(seqs) if seqs is not None else float((mask.sum(-1) > 0).sum())
    factor = rows * dp / max(denominator, 1.0)
    if mode == "seq-mean-token-sum-norm" and scale is not None:
        # ours divides by the padded length, verl by loss_scale_factor
        factor *= mask.shape[-1] / float(scale)
    return mode, None, 1, factor


def _sis_policy_loss(
    loss_name: str,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: Tensor | None,
    clip_dual: float | None,
) -> tuple[Tensor, dict[str, Any]]:
    tokens = _CURRENT.get()
    if tokens is None:
        raise RuntimeError(
            "the SIS policy loss needs q's top-K: install `sis_actor_loss` as the actor loss, "
            "or call it inside `with sis_tokens(SISTokens(...))`"
        )
    if rollout_is_weights is not None:
        raise ValueError(
            "SIS replaces verl's rollout importance weights: set algorithm.rollout_correction.rollout_is=null"
        )
    if config is None:
        raise ValueError("the SIS policy loss needs verl's actor config (clip ratios, global batch info)")
    ratio = compute_log_ratio(
        "sis",
        logp=log_prob,
        logq=old_log_prob,  # bypass mode: verl passes the rollout log-probs as old_log_prob
        mask=response_mask,
        topk_logp=tokens.topk_logp,
        topk_logq=tokens.topk_logq,
        in_topk=tokens.in_topk,
        generator=_generator(log_prob.device),
    )
    clip = config.clip_ratio
    agg_mode, global_tokens, dp_size, factor = _verl_aggregation(
        loss_agg_mode, response_mask, dict(getattr(config, "global_batch_info", None) or {})
    )
    loss, metrics = get_policy_loss(loss_name)(
        log_ratio=ratio.log_ratio,
        advantages=advantages,
        mask=response_mask,
        agg_mode=agg_mode,
        clip_low=config.clip_ratio_low if config.clip_ratio_low is not None else clip,
        clip_high=config.clip_ratio_high if config.clip_ratio_high is not None else clip,
        clip_dual=clip_dual,
        weights=ratio.weights,
        global_tokens=global_tokens,
        dp_size=dp_size,
    )
    # verl's dashboards read actor/pg_clipfrac; verl's Metric turns the scalar tensors into floats.
    return loss * factor, {**ratio.metrics, **metrics, "actor/pg_clipfrac": metrics["loss/clipfrac"]}


@register_policy_loss(SIS_LOSS)  # type: ignore[arg-type]
def sis_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """PPO/DAPO clipped loss on the SIS ratio ([B, T] tensors; DAPO = clip_ratio_high 0.28 + token-mean)."""
    dual = config.get("clip_ratio_c", 3.0) if config is not None else None
    return _sis_policy_loss(
        "grpo",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        dual,
    )


@register_policy_loss(SIS_GSPO_LOSS)  # type: ignore[arg-type]
def sis_gspo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """GSPO on SIS per-token log-ratios (accepted tokens add 0 to log s_i); no dual clip, as verl's `gspo`."""
    return _sis_policy_loss(
        "gspo",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        None,
    )


def rank_topk(
    position_logprobs: Sequence[Mapping[int, Any]], k: int
) -> tuple[list[list[int]], list[list[float]]]:
    """q's top-K ids and log-probs per response token from vLLM's per-token `{token_id: Logprob}` dicts.

    With `logprobs=K` vLLM returns the K most probable tokens (`Logprob.rank` 1..K) plus the sampled token
    when it ranks lower; the sampled one is dropped here unless it is in the top K. Returns [T][K] ids and
    log-probs.
    """
    ids, logprobs = [], []
    for entries in position_logprobs:
        top = sorted(entries.items(), key=lambda item: item[1].rank)[:k]
        if len(top) < k:
            raise ValueError(f"vLLM returned {len(top)} log-probs for a token, expected K={k}")
        ids.append([int(token) for token, _ in top])
        logprobs.append([float(entry.logprob) for _, entry in top])
    return ids, logprobs


def response_tensor(value: Any, width: int, fill: float, dtype: torch.dtype) -> Tensor:
    """A [B, width, K] tensor from a tensor or from per-sequence [T_i][K] lists (how the rollout server's
    `extra_fields` reach the actor); rows are right-padded with `fill`."""
    if isinstance(value, Tensor):
        return value
    rows = [torch.tensor(list(row), dtype=dtype).reshape(len(row), -1) for row in value]
    k = max((r.shape[1] for r in rows if r.numel()), default=1)
    out = torch.full((len(rows), width, k), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out


def _sis_batch(data: Any) -> tuple[Tensor, Tensor]:
    """(`sis_topk_ids` [B, T, K] int64, `sis_topk_logq` [B, T, K]) of a micro-batch, on the responses' device.

    Padding carries log q = +inf, so padded ranks never win the max of log pi - log q (they only occur at
    masked positions).
    """
    responses = _padded_responses(data)
    width = responses.shape[1]
    ids = response_tensor(data["sis_topk_ids"], width, 0, torch.long).to(responses.device)
    logq = response_tensor(data["sis_topk_logq"], width, math.inf, torch.float32).to(responses.device)
    return ids, logq


def _padded_responses(data: Any) -> Tensor:
    """Response ids [B, T] (right-padded with 0) whether verl stored them padded or nested."""
    responses = data["responses"]
    if not responses.is_nested:
        return responses
    width = tu.get_non_tensor_data(data=data, key="max_response_len", default=-1)
    width = int(width) if width > 0 else int(responses.offsets().diff().max())
    return responses.to_padded_tensor(0, (responses.size(0), width))


def _lengths(data: Any) -> tuple[list[int], list[int]]:
    """Valid prompt and response lengths per sequence, read as verl's `no_padding_2_padding` reads them."""
    prompts = data["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist(), data["responses"].offsets().diff().tolist()
    attention_mask = data["attention_mask"]
    width = prompts.shape[1]
    return attention_mask[:, :width].sum(dim=1).tolist(), attention_mask[:, width:].sum(dim=1).tolist()


def _packed_positions(data: Any) -> tuple[list[int], list[int]]:
    """Per sequence: packed index of the logit that predicts its first response token, and the response
    length.

    Same layout as verl's `no_padding_2_padding`: sequences packed back to back (valid prompt then valid
    response), the logit at packed index i predicting token i + 1.
    """
    prompt_lens, response_lens = _lengths(data)
    starts, offset = [], 0
    for p, r in zip(prompt_lens, response_lens, strict=True):
        starts.append(offset + p - 1)
        offset += p + r
    return starts, response_lens


def topk_logp_outputs(student_logits: Tensor, data: Any) -> dict[str, Tensor]:
    """Logits-processor half: log pi at q's top-K ids for every packed token, one [1, N] tensor per rank.

    student_logits [1, N, V] (N packed tokens, temperature already applied by verl); data["sis_topk_ids"]
    [B, T, K]. Positions outside the responses gather id 0 and are dropped again by `no_padding_2_padding`.
    """
    logits = student_logits.squeeze(0)  # [N, V]
    topk_ids, _ = _sis_batch(data)
    k = topk_ids.shape[-1]
    ids = torch.zeros(logits.shape[0], k, dtype=torch.long, device=logits.device)  # [N, K]
    starts, lens = _packed_positions(data)
    if starts and starts[-1] + lens[-1] + 1 != logits.shape[0]:
        raise ValueError(
            f"packed logits have {logits.shape[0]} rows but the batch has {starts[-1] + lens[-1] + 1} "
            "tokens; SIS does not support Ulysses sequence parallelism"
        )
    for b, (s, r) in enumerate(zip(starts, lens, strict=True)):
        ids[s : s + r] = topk_ids[b, :r].to(logits.device)
    with torch.no_grad():
        logp = gather_logprobs(logits.unsqueeze(0), ids.unsqueeze(0), chunk_size=_GATHER_CHUNK)  # [1, N, K]
    return {TOPK_LOGP_KEY.format(j): logp[..., j] for j in range(k)}


def sis_actor_loss(
    config: Any,
    model_output: dict[str, Any] | None = None,
    data: Any = None,
    dp_group: Any = None,
    student_logits: Tensor | None = None,
) -> Any:
    """verl engine loss function: `actor.set_loss_fn(functools.partial(sis_actor_loss, config=actor_config))`.

    Called with `student_logits` it is the top-K logits processor (`topk_logp_outputs`); called with
    `model_output` it runs verl's `ppo_loss` with the SIS inputs of this micro-batch in context.
    """
    if student_logits is not None:
        return topk_logp_outputs(student_logits, data)
    if model_output is None or data is None:
        raise ValueError("sis_actor_loss needs either student_logits or model_output and data")
    topk_ids, topk_logq = _sis_batch(data)
    k = topk_ids.shape[-1]
    if TOPK_LOGP_KEY.format(0) not in model_output:
        raise RuntimeError(
            "no top-K log-probs in the model output: set distillation_use_topk=True on the batch"
        )
    ranks = [no_padding_2_padding(model_output[TOPK_LOGP_KEY.format(j)], data) for j in range(k)]
    topk_logp = torch.stack(ranks, dim=-1)  # [B, T, K]
    tokens = SISTokens(
        topk_logp=topk_logp,
        topk_logq=topk_logq.to(topk_logp.device),
        in_topk=token_in_topk(_padded_responses(data), topk_ids).to(topk_logp.device),
    )
    with sis_tokens(tokens):
        return ppo_loss(config, model_output, data, dp_group)


__all__ = [
    "SIS_GSPO_LOSS",
    "SIS_LOSS",
    "SISTokens",
    "rank_topk",
    "response_tensor",
    "sis_actor_loss",
    "sis_gspo_policy_loss",
    "sis_policy_loss",
    "sis_tokens",
    "topk_logp_outputs",
]
