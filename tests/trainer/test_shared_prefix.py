"""The shared-prefix forward (policy.prefix_inputs): the prompt tokens all rows start with run once, and the
logits and gradients are those of the full forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from sisrl.trainer.batch import RolloutBatch, Trajectory, collate
from sisrl.trainer.config import ModelConfig
from sisrl.trainer.policy import MIN_SHARED_PREFIX, common_prefix_length, load_policy, policy_logits
from sisrl.trainer.sis import gather_logprobs

PREFIX = 24  # tokens every prompt starts with (the instructions, in a search agent's prompt)


def shared_prefix_trajectories() -> list[Trajectory]:
    """Six rows: prompts of 3-9 own tokens after a common prefix (two rows of one group share all of it),
    responses of 5-17 tokens, so prompts are left-padded and responses right-padded; every third response token is
    an inserted (mask 0) one."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 500, (PREFIX,), generator=g).tolist()
    own = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 9, 5, 7, 4)]
    prompts = [prefix + own[0], prefix + own[0], *(prefix + o for o in own[1:])]
    responses = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (9, 5, 17, 12, 8, 14)]
    return [Trajectory(id=str(i), item_id=str(i), group_id=str(i), data_source="t", prompt_ids=p, response_ids=r,
                       loss_mask=[int(t % 3 != 1) for t in range(len(r))], behaviour_logprobs=[-1.0] * len(r),
                       topk_ids=[[0]] * len(r), topk_logprobs=[[-1.0]] * len(r), reward=0.0, reward_parts={},
                       finish_reason="stop", policy_version=0)
            for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]


@pytest.fixture(scope="module")
def batch() -> RolloutBatch:
    return collate(shared_prefix_trajectories(), pad_id=0, k=1)


def _logp_and_grads(batch: RolloutBatch, shared: bool, trainable: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model, _ = load_policy(ModelConfig(path="tiny", trainable_layers=trainable), seed=0, device=torch.device("cpu"))
    logits, view = policy_logits(model, batch, compact=True, shared_prefix=shared)
    logp = gather_logprobs(logits, view.response_ids)
    (-(logp * view.mask).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logp[view.mask > 0].detach(), grads


def test_common_prefix_is_the_shared_instructions_capped_below_the_shortest_prompt(batch: RolloutBatch) -> None:
    assert common_prefix_length(batch) == PREFIX  # the shortest prompt has 3 own tokens after it
    group = batch.select(torch.tensor([0, 1]))  # one group: the whole prompt is shared, one token is kept back
    assert common_prefix_length(group) == PREFIX + 3 - 1
    assert common_prefix_length(batch.select(torch.tensor([2]))) == 0  # a single row shares with nobody
    other = batch.input_ids.clone()
    width = batch.input_ids.shape[1] - batch.response_len
    first = width - int(batch.attention_mask[3, :width].sum())
    other[3, first + 10] += 1  # row 3 differs at prompt token 10
    assert common_prefix_length(replace(batch, input_ids=other)) == 10 < MIN_SHARED_PREFIX


@pytest.mark.parametrize("trainable", [None, 1])
def test_shared_prefix_gives_the_full_forwards_logprobs_and_gradients(batch: RolloutBatch, trainable: int | None) -> None:
    # With every layer trained, gradients reach the embeddings through the prefix's keys and values; with the
    # top layer only, they reach it through the prefix rows of that layer. Both must equal the full forward's.
    full_logp, full_grads = _logp_and_grads(batch, shared=False, trainable=trainable)
    logp, grads = _logp_and_grads(batch, shared=True, trainable=trainable)
    torch.testing.assert_close(logp, full_logp, rtol=1e-5, atol=1e-5)
    assert len(grads) == len(full_grads)
    for g, ref in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)

