"""Group-relative advantages (GRPO) and DAPO's dynamic-sampling filter.

Groups are identified by explicit ids (same prompt, same rollout batch), never by row position, so rows from
several data sources may be interleaved freely.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def group_index(group_ids: Sequence[Hashable]) -> tuple[Tensor, int]:
    """Map arbitrary hashable group ids to dense indices: ([N] int64, number of groups)."""
    dense: dict[Hashable, int] = {}
    idx = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long), len(dense)


def grpo_advantages(
    rewards: Tensor, group_ids: Sequence[Hashable], *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps) over the rows of i's group g; without std: R_i - mean_g R.

    rewards [N] -> advantages [N] (one per sequence; broadcast over its tokens by the loss). std is the unbiased
    sample std (torch.std), as in the GRPO paper's implementation; a group of one gets advantage 0.
    """
    if rewards.dim() != 1 or rewards.shape[0] != len(group_ids):
        raise ValueError(f"rewards must be [N] with N = len(group_ids) = {len(group_ids)}, got {tuple(rewards.shape)}")
    idx, n_groups = group_index(group_ids)
    idx = idx.to(rewards.device)
    r = rewards.float()
    count = torch.zeros(n_groups, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(n_groups, device=r.device).index_add_(0, idx, r) / count
    centred = r - mean[idx]
    if not norm_by_std:
        return centred
    sq = torch.zeros(n_groups, device=r.device).index_add_(0, idx, centred.square())
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return centred / (std[idx] + eps)


def dynamic_sampling_mask(rewards: Tensor, group_ids: Sequence[Hashable]) -> Tensor:
    """DAPO dynamic sampling: [N] bool, True for rows of groups whose rewards are not all equal."""
    idx, n_groups = group_index(group_ids)
    idx = idx.to(rewards.device)
    r = rewards.float()
    hi = torch.full((n_groups,), -torch.inf, device=r.device).scatter_reduce(0, idx, r, "amax")
    lo = torch.full((n_groups,), torch.inf, device=r.device).scatter_reduce(0, idx, r, "amin")
    return (hi > lo)[idx]
