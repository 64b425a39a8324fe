"""Trajectory parsing and collation refuse to guess: no silent loss mask, no silently masked policy tokens."""

from __future__ import annotations

from typing import Any

import pytest
from sisrl.trainer.batch import Trajectory, collate


def record(**over: Any) -> dict[str, Any]:
    """A stored trajectory: 2 policy tokens, 1 inserted token (no top-K recorded), 1 policy token; K = 2."""
    base: dict[str, Any] = {
        "id": "t0", "item_id": "q0", "group_id": "g0", "data_source": "nq", "prompt_ids": [5, 6],
        "response_ids": [7, 8, 9, 10], "loss_mask": [1, 1, 0, 1], "behaviour_logprobs": [-0.1, -0.2, 0.0, -0.3],
        "topk_ids": [[7, 1], [8, 1], [], [10, 1]], "topk_logprobs": [[-0.1, -2.0], [-0.2, -2.0], [], [-0.3, -2.0]],
        "reward": 1.0, "policy_version": 0,
    }
    return {**base, **over}


def test_a_record_without_a_loss_mask_is_refused() -> None:
    raw = record()
    del raw["loss_mask"]
    with pytest.raises(ValueError, match="'t0': no loss_mask"):
        Trajectory.from_json(raw)
    with pytest.raises(ValueError, match="no loss_mask"):
        Trajectory.from_json(record(loss_mask=None))


@pytest.mark.parametrize("key", ["reward", "group_id", "policy_version", "id"])
def test_a_record_without_a_required_field_is_refused_naming_it(key: str) -> None:
    for bad in ({k: v for k, v in record().items() if k != key}, record(**{key: None})):
        with pytest.raises(ValueError, match=rf"trajectory {bad.get('id')!r}: no {key} \(required: "):
            Trajectory.from_json(bad)
    if key in ("group_id", "id"):  # "" would merge such trajectories into one GRPO group
        with pytest.raises(ValueError, match=rf": no {key} \("):
            Trajectory.from_json(record(**{key: ""}))
    assert Trajectory.from_json(record(reward=0)).reward == 0.0  # a zero reward is a reward


def test_inserted_tokens_carry_mask_zero_and_policy_tokens_one() -> None:
    batch = collate([Trajectory.from_json(record())], pad_id=0, k=2)
    assert batch.mask.tolist() == [[1.0, 1.0, 0.0, 1.0]]
    assert batch.topk_ids[0, 3].tolist() == [10, 1] and batch.topk_ids[0, 2].tolist() == [0, 0]


def test_a_policy_token_with_fewer_than_k_recorded_logprobs_is_an_error() -> None:
    traj = Trajectory.from_json(record())
    with pytest.raises(ValueError, match=r"policy token 0 has a top-K row of 2 entries, fewer than K=3"):
        collate([traj], pad_id=0, k=3)
