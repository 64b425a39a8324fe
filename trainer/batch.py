"""Trajectories from the gateway and the padded tensors the update reads.

Layout of a `RolloutBatch` (B sequences, P = longest prompt, T = longest response, K = top-K):
prompts are left-padded and responses right-padded, so every response starts at column P and the logits that
predict it are one contiguous slice (no gather, no second [B, T, V] tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

# A per-token field: a list (the JSON form, trajectories built in Python) or a read-only numpy view of an Arrow
# page's buffer (`trainer/arrow_batch.py`: the trainer's path, no per-token Python objects).
Ints = list[int] | np.ndarray
Floats = list[float] | np.ndarray
Rows = list[list[int]] | list[list[float]] | np.ndarray  # [T][K]


@dataclass(frozen=True, eq=False)
class Trajectory:
    """One trajectory as the gateway records it (fields this trainer reads; wire names kept). Two trajectories
    are equal when every field holds the same values, whichever form (list or array) holds them."""

    id: str
    item_id: str
    group_id: str
    data_source: str
    prompt_ids: Ints
    response_ids: Ints
    loss_mask: Ints  # [T] 1 = sampled by the policy, 0 = inserted by the environment
    behaviour_logprobs: Floats  # [T] log q(y_t)
    topk_ids: Rows  # [T][K]
    topk_logprobs: Rows  # [T][K]
    reward: float
    reward_parts: dict[str, float] = field(default_factory=dict)  # em, f1, format
    turns: list[Any] = field(default_factory=list)
    finish_reason: str = ""
    answer: str | None = None
    policy_version: int = 0  # version that sampled the first token
    token_versions: Ints | None = None  # [T] version that sampled each token (-1 inserted); None = all policy_version
    error: str | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return all(plain(getattr(self, f.name)) == plain(getattr(other, f.name)) for f in fields(self))

    @property
    def policy_tokens(self) -> int:
        """How many response tokens the policy sampled (loss mask 1)."""
        return int(np.count_nonzero(np.asarray(self.loss_mask)))

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Trajectory:
        """A trajectory from its wire form. A missing or null required field is a ValueError naming the field
        and the trajectory, never a default: a reward of 0.0 would be trained on, an empty group id would merge
        every such trajectory into one GRPO group, ones for a loss mask would train on the retrieved passages."""
        names = {f.name for f in fields(Trajectory)}
        kept = {k: v for k, v in obj.items() if k in names}
        missing = [key for key in REQUIRED if kept.get(key) is None or (key in _NON_EMPTY and kept[key] == "")]
        if missing:
            raise ValueError(f"trajectory {obj.get('id')!r}: no {', no '.join(missing)} (required: "
                             f"{', '.join(REQUIRED)}); refusing to train on a guess")
        kept["reward"] = float(kept["reward"])
        kept["policy_version"] = int(kept["policy_version"])
        kept["reward_parts"] = {k: float(v) for k, v in (kept.get("reward_parts") or {}).items() if v is not None}
        kept["turns"] = kept.get("turns") or []
        for key in ("group_id", "item_id", "data_source", "id"):
            kept[key] = str(kept.get(key) or "")
        return Trajectory(**kept)

    def to_json(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}


def plain(value: Any) -> Any:
    """`value` with numpy arrays as (nested) Python lists, as JSON holds it."""
    return value.tolist() if isinstance(value, np.ndarray) else value


# Fields a trajectory must carry to be trained on (`from_json`); the loss mask first: its message is the oldest.
REQUIRED = ("loss_mask", "id", "group_id", "reward", "policy_version", "prompt_ids", "response_ids",
            "behaviour_logprobs", "topk_ids", "topk_logprobs")
_NON_EMPTY = ("id", "group_id")  # an empty string is missing too


@dataclass(frozen=True)
class RolloutBatch:
    """Padded tensors of B trajectories. Shapes in the field comments."""

    input_ids: Tensor  # [B, P+T] left-padded prompt, then right-padded response
    attention_mask: Tensor  # [B, P+T] 1 on real tokens
    position_ids: Tensor  # [B, P+T] 0-based positions of real tokens (pads repeat 0)
    response_ids: Tensor  # [B, T]
    mask: Tensor  # [B, T] float, 1 = policy token that counts in losses and SIS statistics
    logq: Tensor  # [B, T] behaviour log-prob of each response token
    topk_ids: Tensor  # [B, T, K] behaviour top-K ids
    topk_logq: Tensor  # [B, T, K] behaviour top-K log-probs
    rewards: Tensor  # [B]
    group_ids: tuple[str, ...]  # [B]
    # Set only on a compacted token view (`compact`): [B, T'] response columns of the per-token fields.
    positions: Tensor | None = None

    @property
    def compacted(self) -> bool:
        return self.positions is not None

    @property
    def size(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_ids.shape[1])

    def select(self, idx: Tensor) -> RolloutBatch:
        """Rows `idx` ([n] long) of every field."""
        rows = idx.tolist()
        return replace(
            self,
            **{name: getattr(self, name)[idx] for name in _TENSOR_FIELDS},
            group_ids=tuple(self.group_ids[i] for i in rows),
            positions=None if self.positions is None else self.positions[idx],
        )

    def to(self, device: torch.device) -> RolloutBatch:
        return replace(self, **{name: getattr(self, name).to(device) for name in _TENSOR_FIELDS},
                       positions=None if self.positions is None else self.positions.to(device))

    def with_behaviour(self, logq: Tensor, topk_ids: Tensor, topk_logq: Tensor) -> RolloutBatch:
        return replace(self, logq=logq, topk_ids=topk_ids, topk_logq=topk_logq)

    def with_mask(self, mask: Tensor) -> RolloutBatch:
        return replace(self, mask=mask)

    def compact(self) -> RolloutBatch:
        """The per-token fields at the policy's own tokens only, moved left in order: [B, T'] with T' = the most
        mask-1 tokens of any row (slots past a row's count carry mask 0). Per-token losses, SIS statistics and
        per-sequence aggregates are unchanged by dropping mask-0 positions. `positions` records the columns; the
        input fields stay as they are (the forward pass still reads the whole sequence)."""
        keep = self.mask > 0
        width = max(int(keep.sum(dim=1).max()), 1)
        # stable sort on "not kept" puts each row's kept columns first, in their original order
        cols = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # [B, T']
        k = self.topk_ids.shape[-1]
        by_k = cols.unsqueeze(-1).expand(-1, -1, k)
        return replace(
            self, response_ids=self.response_ids.gather(1, cols), mask=self.mask.gather(1, cols),
            logq=self.logq.gather(1, cols), topk_ids=self.topk_ids.gather(1, by_k),
            topk_logq=self.topk_logq.gather(1, by_k), positions=cols,
        )


_TENSOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "response_ids", "mask", "logq", "topk_ids",
                  "topk_logq", "rewards")


def collate(trajs: list[Trajectory], *, pad_id: int, k: int) -> RolloutBatch:
    """Pad trajectories into a RolloutBatch. Environment tokens (loss mask 0, no top-K recorded) are filled
    with id 0 / log-prob 0 and carry mask 0. A policy token whose recorded top-K is shorter than `k` is an
    error: silently masking it would train on nothing when the gateway records fewer log-probs than K."""
    if not trajs:
        raise ValueError("collate needs at least one trajectory")
    b = len(trajs)
    p = max(len(t.prompt_ids) for t in trajs)
    t_len = max(max(len(t.response_ids) for t in trajs), 1)
    input_ids = torch.full((b, p + t_len), pad_id, dtype=torch.long)
    attn = torch.zeros((b, p + t_len), dtype=torch.long)
    resp = torch.full((b, t_len), pad_id, dtype=torch.long)
    mask = torch.zeros((b, t_len))
    logq = torch.zeros((b, t_len))
    topk_ids = torch.zeros((b, t_len, k), dtype=torch.long)
    topk_logq = torch.zeros((b, t_len, k))
    for i, tr in enumerate(trajs):
        n_p, n_r = len(tr.prompt_ids), len(tr.response_ids)
        if not (len(tr.loss_mask) == len(tr.behaviour_logprobs) == n_r):
            raise ValueError(f"trajectory {tr.id}: loss_mask/behaviour_logprobs lengths differ from response_ids ({n_r})")
        input_ids[i, p - n_p : p] = torch.tensor(tr.prompt_ids, dtype=torch.long)
        input_ids[i, p : p + n_r] = torch.tensor(tr.response_ids, dtype=torch.long)
        attn[i, p - n_p : p + n_r] = 1
        resp[i, :n_r] = torch.tensor(tr.response_ids, dtype=torch.long)
        logq[i, :n_r] = torch.tensor(tr.behaviour_logprobs, dtype=torch.float32)
        for t, (ids, lps) in enumerate(zip(tr.topk_ids, tr.topk_logprobs, strict=True)):
            if tr.loss_mask[t] and len(ids) < k:
                raise ValueError(f"trajectory {tr.id}: policy token {t} has a top-K row of {len(ids)} entries, "
                                 f"fewer than K={k} (algorithm.logprobs_k); ask the gateway for "
                                 f"sampling.logprobs_k >= {k}")
            if tr.loss_mask[t]:
                topk_ids[i, t] = torch.tensor(ids[:k], dtype=torch.long)
                topk_logq[i, t] = torch.tensor(lps[:k], dtype=torch.float32)
                mask[i, t] = 1.0
    position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)
    rewards = torch.tensor([tr.reward for tr in trajs], dtype=torch.float32)
    return RolloutBatch(input_ids, attn, position_ids, resp, mask, logq, topk_ids, topk_logq, rewards,
                        tuple(tr.group_id for tr in trajs))
