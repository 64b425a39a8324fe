"""SIS inside TRL: `SISGRPOTrainer`, a `trl.GRPOTrainer` whose loss uses the SIS ratio (tested with TRL 1.16).

Usage: replace `GRPOConfig`/`GRPOTrainer` by `SISGRPOConfig`/`SISGRPOTrainer`; `sis_k` and `sis_strategy` are
the new knobs. Three override points of TRL's trainer, nothing else:
- `_generate_and_score_completions`: after TRL builds the generation batch, add the behaviour policy q per
  response token: `sis_logq` [B, T], `sis_topk_ids` [B, T, K], `sis_topk_logq` [B, T, K]. On the vLLM path
  they come from the engine (`logprobs=K`, the `rollout` source of q: docs/design.md, "Staleness and the
  source of q"); on the transformers path from a no-grad forward of the weights that just generated
  (`recompute` source). TRL's `shuffle_sequence_dict`/`split_tensor_dict` permute and split every tensor along
  the batch dimension, so these keys follow their rows through the `num_iterations` reuse.
- `_compute_loss`: one forward for the logits of the completion, pi at the sampled token and at q's top-K ids
  (`sis.token_and_topk_logprobs`), the ratio from `losses.compute_log_ratio`, the loss from
  `losses.get_policy_loss`. The accept test is redone at every call with the current weights, so at every one
  of the `num_iterations` updates.
- the vLLM generator's `generate`: asks for K log-probs and puts the sampled token's entry first, because TRL
  keeps entry 0 (the rank-1 token, not the sampled one) as the sampling log-prob.
TRL's own vLLM importance-sampling correction is switched off by the config when SIS is on (nothing is
corrected twice). Imported only by users of this plug-in: `import sisrl.trainer` never imports TRL.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from sisrl.trainer.losses import RATIO_STRATEGIES, compute_log_ratio, get_policy_loss
from sisrl.trainer.sis import behaviour_topk, token_and_topk_logprobs, token_in_topk
from torch import Tensor
from trl import GRPOConfig, GRPOTrainer

log = logging.getLogger(__name__)

SIS_KEYS = ("sis_logq", "sis_topk_ids", "sis_topk_logq")
# TRL loss type -> how our per-token loss is reduced (as TRL 1.16's `GRPOTrainer._compute_loss` reduces it).
_AGG = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum",
    "dapo": "token-mean",
}
# Extra loss terms and TRL loss types the SIS path does not reproduce; refused rather than silently dropped.
_UNSUPPORTED = (
    ("beta", 0.0, "the KL penalty to a reference model"),
    ("delta", None, "two-sided clipping"),
    ("top_entropy_quantile", 1.0, "the high-entropy token mask"),
    ("entropy_coef", 0.0, "the entropy bonus"),
    ("use_adaptive_entropy", False, "the adaptive entropy bonus"),
    ("off_policy_mask_threshold", None, "the off-policy sequence mask"),
    ("use_liger_kernel", False, "Liger's fused loss (SIS gathers K log-probs from the logits)"),
)


@dataclass
class SISGRPOConfig(GRPOConfig):
    """`GRPOConfig` plus the SIS knobs; every other field keeps TRL's meaning and default."""

    sis_strategy: str = field(
        default="sis",
        metadata={
            "help": "Importance ratio in the loss: 'sis', 'is', 'tis', 'icepop', or 'off' for TRL's own loss."
        },
    )
    sis_k: int = field(
        default=20, metadata={"help": "K: size of the behaviour top-K set V_K (10-50 in the paper)."}
    )
    sis_seed: int = field(
        default=0, metadata={"help": "Seed of the uniforms u of the accept test (plus the rank)."}
    )
    sis_chunk_size: int | None = field(
        default=None,
        metadata={"help": "Gather log-probs in chunks of this many time steps (None: one chunk)."},
    )
    sis_tis_cap: float = field(default=2.0, metadata={"help": "Ratio cap C of the 'tis' strategy."})
    sis_icepop_low: float = field(
        default=0.5, metadata={"help": "Lower ratio bound of the 'icepop' strategy."}
    )
    sis_icepop_high: float = field(
        default=2.0, metadata={"help": "Upper ratio bound of the 'icepop' strategy."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sis_strategy not in (*RATIO_STRATEGIES, "off"):
            raise ValueError(
                f"sis_strategy must be one of {[*RATIO_STRATEGIES, 'off']}, got {self.sis_strategy!r}"
            )
        if self.sis_strategy == "off":
            return
        if self.sis_k < 1:
            raise ValueError(f"sis_k must be an integer >= 1, got {self.sis_k!r}")
        if self.use_vllm and self.vllm_mode == "colocate" and self.sis_k > 20:
            # TRL builds the colocated `vllm.LLM` with vLLM's default max_logprobs (20); vllm-serve lifts it.
            raise ValueError(
                f"sis_k={self.sis_k} exceeds vLLM's default max_logprobs=20 in colocate mode; use <= 20"
            )
        if self.loss_type not in _AGG:
            raise ValueError(
                f"loss_type {self.loss_type!r} is not supported with SIS; expected one of {list(_AGG)}"
            )
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                "importance_sampling_level must be 'token' or 'sequence', "
                f"got {self.importance_sampling_level!r}"
            )
        for name, neutral, what in _UNSUPPORTED:
            if getattr(self, name, neutral) != neutral:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} ({what}) is not supported with SIS; "
                    f"set {name}={neutral!r}"
                )
        # SIS already turns stale and mismatched tokens on-policy; TRL's correction would add a second ratio.
        self.vllm_importance_sampling_correction = False


def sampled_first(
    logprobs: Sequence[Sequence[Sequence[float | None]]],
    token_ids: Sequence[Sequence[Sequence[int]]],
    completion_ids: Sequence[Sequence[int]],
    k: int,
) -> tuple[
    list[list[list[float | None]]], list[list[list[int]]], list[list[list[int]]], list[list[list[float]]]
]:
    """Split vLLM's per-token candidates into the sampled token's entry and q's top-K.

    Input (TRL's `VLLMGeneration.generate` with `logprobs=K`): per sequence, per token, up to K + 1 (log-prob,
    id) pairs sorted by rank; the sampled token is among them even when it is outside the top K. Returns the
    candidates reordered so the sampled token comes first (TRL reads entry 0 as the sampling log-prob), and
    the top-K ids and log-probs in rank order. Missing entries (NaN/None, or fewer than K returned) get log q
    = +inf, so they never win M_t = max_v pi(v) / q(v).
    """
    first_lp: list[list[list[float | None]]] = []
    first_ids: list[list[list[int]]] = []
    topk_ids: list[list[list[int]]] = []
    topk_lp: list[list[list[float]]] = []
    for seq_lp, seq_ids, sampled in zip(logprobs, token_ids, completion_ids, strict=True):
        if len(seq_lp) != len(sampled):
            raise ValueError(
                f"vLLM returned log-probs for {len(seq_lp)} tokens but the completion has {len(sampled)}"
            )
        row_lp, row_ids, row_top, row_toplp = [], [], [], []
        for lp, ids, tok in zip(seq_lp, seq_ids, sampled, strict=True):
            j = list(ids).index(tok)  # ValueError here means vLLM did not include the sampled token
            row_lp.append([lp[j], *lp[:j], *lp[j + 1 :]])
            row_ids.append([ids[j], *ids[:j], *ids[j + 1 :]])
            top = [
                (i, math.inf if x is None or math.isnan(x) else x)
                for i, x in list(zip(ids, lp, strict=True))[:k]
            ]
            top += [(0, math.inf)] * (k - len(top))
            row_top.append([i for i, _ in top])
            row_toplp.append([x for _, x in top])
        first_lp.append(row_lp)
        first_ids.append(row_ids)
        topk_ids.append(row_top)
        topk_lp.append(row_toplp)
    return first_lp, first_ids, topk_ids, topk_lp


def _pad_right(
    rows: Sequence[Sequence[Any]], width: int, fill: float, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Right-pad per-sequence lists ([T_i] or [T_i, K]) into a [B, width(, K)] tensor."""
    tensors = [torch.tensor(r, dtype=dtype) for r in rows]
    shape = (len(rows), width, *tensors[0].shape[1:]) if tensors else (0, width)
    out = torch.full(shape, fill, dtype=dtype)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out.to(device)


class SISGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with the SIS ratio (or IS/TIS/IcePop) in the loss; holds no formula of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.args
        if not isinstance(cfg, SISGRPOConfig):
            raise ValueError(f"SISGRPOTrainer needs args=SISGRPOConfig(...), got {type(cfg).__name__}")
        self.sis_args = cfg
        self.sis_on = cfg.sis_strategy != "off"
        self._sis_generator: torch.Generator | None = None
        self._sis_vllm_batch: (
            tuple[list[list[list[int]]], list[list[list[float]]], list[list[float]]] | None
        ) = None
        if self.sis_on and self.use_vllm:
            if self.tools or self.rollout_func is not None:
                raise ValueError(
                    "SIS on the vLLM path supports single-turn generation only (no tools, no rollout_func)"
                )
            self.vllm_generation.logprobs = cfg.sis_k
            wrapped = self._wrap_vllm_generate(self.vllm_generation.generate)
            self.vllm_generation.generate = wrapped  # type: ignore[method-assign]

    # --- behaviour policy q, recorded once per generation
    # ---------------------------------------------------------

    def _wrap_vllm_generate(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        k = self.sis_args.sis_k

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            prompt_ids, completion_ids, logprobs, token_ids = generate(*args, **kwargs)
            if logprobs is None or token_ids is None:
                raise RuntimeError("vLLM returned no log-probs; SIS needs them (logprobs=K)")
            logprobs, token_ids, top_ids, top_lp = sampled_first(logprobs, token_ids, completion_ids, k)
            sampled = [[math.nan if t[0] is None else t[0] for t in seq] for seq in logprobs]
            self._sis_vllm_batch = (top_ids, top_lp, sampled)
            return prompt_ids, completion_ids, logprobs, token_ids

        return wrapped

    def _completion_logits(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        """Logits that predict each completion token: [B, T, V] (position t scores completion_ids[:, t])."""
        if "pixel_values" in inputs:
            raise ValueError("SISGRPOTrainer supports text-only models")
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        t = completion_ids.shape[1]
        # logits_to_keep = T + 1: the last prompt position predicts the first completion token; the last one
        # is unused.
        with self.accelerator.autocast():  # the same mixed precision as TRL's own log-prob forward
            out = model(
                input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=t + 1, use_cache=False
            )
        return out.logits[:, :-1, :]

    def _behaviour_fields(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """`sis_logq` [B, T], `sis_topk_ids` [B, T, K], `sis_topk_logq` [B, T, K] for a fresh generation
        batch."""
        cfg = self.sis_args
        completion_ids = batch["completion_ids"]
        width, device = completion_ids.shape[1], completion_ids.device
        if self.use_vllm:
            if self._sis_vllm_batch is None:
                raise RuntimeError("no vLLM log-probs were recorded for this generation batch")
            top_ids, top_lp, sampled = self._sis_vllm_batch
            self._sis_vllm_batch = None
            return {
                "sis_logq": _pad_right(sampled, width, 0.0, torch.float32, device),
                "sis_topk_ids": _pad_right(top_ids, width, 0, torch.long, device),
                "sis_topk_logq": _pad_right(
                    top_lp, width, math.inf, torch.float32, device
                ),  # masked positions
            }
        # `recompute` source: same weights as the generation, no grad, in chunks of the training micro-batch
        # size.
        model = self.model
        assert model is not None  # GRPOTrainer always holds its model
        step = cfg.per_device_train_batch_size
        parts: list[tuple[Tensor, Tensor, Tensor]] = []
        with torch.no_grad():
            for s in range(0, completion_ids.shape[0], step):
                rows = {
                    key: batch[key][s : s + step]
                    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
                }
                logits = self._completion_logits(model, rows)
                parts.append(
                    behaviour_topk(
                        logits, rows["completion_ids"], cfg.sis_k, self.temperature, cfg.sis_chunk_size
                    )
                )
        logq, topk_ids, topk_logq = (torch.cat(p, dim=0) for p in zip(*parts, strict=True))
        return {"sis_logq": logq, "sis_topk_ids": topk_ids, "sis_topk_logq": topk_logq}

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = super()._generate_and_score_completions(inputs)
        if self.sis_on:
            fields = self._behaviour_fields(batch)
            unscored = torch.isnan(fields["sis_logq"])
            if unscored.any():  # vLLM could not score these tokens: they count nowhere (loss mask 0)
                keep = (~unscored).to(batch["completion_mask"].dtype)
                batch["tool_mask"] = keep if "tool_mask" not in batch else batch["tool_mask"] * keep
                fields["sis_logq"] = torch.nan_to_num(fields["sis_logq"], nan=0.0)
            batch.update(fields)
        return batch

    # --- the loss, at every update
    # ----------------------------------------------------------------------------------

    def _generator(self, device: torch.device) -> torch.Generator:
        if self._sis_generator is None:
            self._sis_generator = torch.Generator(device=device)
            self._sis_generator.manual_seed(self.sis_args.sis_seed + self.accelerator.process_index)
        return self._sis_generator

    def _aggregation(self, inputs: dict[str, Any], mode: str) -> tuple[str, float | None, int, float]:
        """(agg_mode, global_tokens, dp_size, divisor) reproducing TRL's normalisation of `loss_type`."""
        cfg = self.sis_args
        # both set by GRPOConfig.__post_init__
        assert cfg.steps_per_generation is not None and cfg.max_completion_length is not None
        accumulation = float(self.current_gradient_accumulation_steps) if mode == "train" else 1.0
        if cfg.loss_type == "dapo":
            # TRL: sum / (tokens of the generation batch / processes * accumulation / steps_per_generation)
            tokens = float(inputs["num_items_in_batch"])
            if mode == "train":
                tokens = tokens * accumulation / cfg.steps_per_generation
            return "token-mean", tokens, self.accelerator.num_processes, 1.0
        divisor = accumulation * (cfg.max_completion_length if cfg.loss_type == "dr_grpo" else 1.0)
        return _AGG[cfg.loss_type], None, 1, divisor

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        if not self.sis_on:
            return super()._compute_loss(model, inputs)
        cfg = self.sis_args
        mode = "train" if model.training else "eval"
        completion_ids = inputs["completion_ids"]
        mask = (
            inputs["completion_mask"]
            if "tool_mask" not in inputs
            else inputs["completion_mask"] * inputs["tool_mask"]
        )
        topk_ids = inputs["sis_topk_ids"]
        logits = self._completion_logits(model, inputs)  # [B, T, V]
        logp, topk_logp = token_and_topk_logprobs(
            logits, completion_ids, topk_ids, self.temperature, cfg.sis_chunk_size
        )
        ratio = compute_log_ratio(
            cfg.sis_strategy,
            logp=logp,
            logq=inputs["sis_logq"],
            mask=mask,
            topk_logp=topk_logp,
            topk_logq=inputs["sis_topk_logq"],
            in_topk=token_in_topk(completion_ids, topk_ids),
            generator=self._generator(logp.device),
            tis_cap=cfg.sis_tis_cap,
            icepop_low=cfg.sis_icepop_low,
            icepop_high=cfg.sis_icepop_high,
        )
        agg_mode, global_tokens, dp_size, divisor = self._aggregation(inputs, mode)
        loss_name = "gspo" if cfg.importance_sampling_level == "sequence" else "grpo"
        loss, metrics = get_policy_loss(loss_name)(
            log_ratio=ratio.log_ratio,
            advantages=inputs["advantages"],
            mask=mask,
            agg_mode=agg_mode,
            clip_low=self.epsilon_low,
            clip_high=self.epsilon_high,
            weights=ratio.weights,
            global_tokens=global_tokens,
            dp_size=dp_size,
        )
        self._log_sis_metrics(mode, {**ratio.metrics, **metrics})
        return loss / divisor

    def _log_sis_metrics(self, mode: str, metrics: dict[str, Tensor]) -> None:
        """Average each metric over processes (min/max for the ratio extremes) into TRL's metric buffer."""
        for name, value in metrics.items():
            gathered = self.accelerator.gather(value.detach().float().reshape(1))
            if name.endswith("_min"):
                reduced = gathered.min()
            elif name.endswith("_max"):
                reduced = gathered.max()
            else:
                reduced = gathered.mean()
            self._metrics[mode][name].append(reduced.item())  # one host sync per metric per micro-batch


__all__ = ["SIS_KEYS", "SISGRPOConfig", "SISGRPOTrainer", "sampled_first"]
