"""Tensor helpers shared by the trainer's math and the engines (imports torch only)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over the positions where `mask` is non-zero; 0 when there are none.

    `x` and `mask` have the same shape (usually [batch, time]); `mask` is bool or 0/1 float (the loss mask).
    Masked positions are selected away with `torch.where`, never multiplied by 0: NaN * 0 is NaN, so a NaN or
    inf at a masked position (a retrieved-passage token) would otherwise reach the mean (docs/design.md,
    "Masking": masked tokens count nowhere).
    """
    if x.shape != mask.shape:
        raise ValueError(f"masked_mean: x shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}")
    keep = mask if mask.dtype == torch.bool else mask != 0
    return torch.where(keep, x, torch.zeros_like(x)).sum() / keep.sum().clamp(min=1)
