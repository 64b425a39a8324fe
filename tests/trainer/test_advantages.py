"""GRPO advantages and DAPO dynamic sampling, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from sisrl.trainer.advantages import dynamic_sampling_mask, grpo_advantages


def test_grpo_advantages_hand_computed() -> None:
    # Group g: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); advantages +-0.5 / 0.57735.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = grpo_advantages(rewards, ["g"] * 4, eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]))
    torch.testing.assert_close(grpo_advantages(rewards, ["g"] * 4, norm_by_std=False),
                               torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_interleaved_groups_across_data_sources_stay_separate() -> None:
    # nq group rewards (1, 0) and hotpotqa group (0.2, 0.2, 0.8) interleaved row by row.
    rewards = torch.tensor([1.0, 0.2, 0.0, 0.2, 0.8])
    groups = [("nq", "q1"), ("hotpotqa", "q1"), ("nq", "q1"), ("hotpotqa", "q1"), ("hotpotqa", "q1")]
    adv = grpo_advantages(rewards, groups, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.2, -0.5, -0.2, 0.4]))


def test_single_and_constant_groups_get_zero_advantage() -> None:
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 1.0]), ["a", "b", "b"])
    torch.testing.assert_close(adv, torch.zeros(3))


def test_dynamic_sampling_drops_constant_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    keep = dynamic_sampling_mask(rewards, ["a", "a", "b", "b", "c", "c"])
    assert keep.tolist() == [False, False, True, True, False, False]


def test_shape_mismatch_is_reported() -> None:
    with pytest.raises(ValueError, match="len\\(group_ids\\) = 2"):
        grpo_advantages(torch.zeros(3), ["a", "b"])
