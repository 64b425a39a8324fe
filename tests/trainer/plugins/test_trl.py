"""SISGRPOTrainer on CPU: a tiny random Llama over the real SmolLM2 tokenizer, prompts built here.

Generation uses `top_k = sis_k`, so every sampled token lies in q's top-K and, before any update (pi = q), the
accept test w/M = 1 >= u accepts every token.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install 'sisrl[trl]')")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset  # noqa: E402
from sisrl.common.models import build_tiny_policy, load_tokenizer  # noqa: E402
from sisrl.trainer.plugins.trl import SISGRPOConfig, SISGRPOTrainer, sampled_first  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

K = 8
PROMPTS = [
    "Who wrote Hamlet?",
    "What is the capital of France?",
    "Name a prime number.",
    "Why is the sky blue?",
]


def length_reward(completions: list[str], **_: Any) -> list[float]:
    """Reward = completion length in characters: varies within a group, so advantages are non-zero."""
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


def _config(tmp_path: Path, **overrides: Any) -> SISGRPOConfig:
    base: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16; its coarse logits tie at the K-th value and blur V_K's edge
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        num_iterations=2,
        top_k=K,
        sis_k=K,
        learning_rate=1e-2,
        seed=0,
        loss_type="grpo",
    )
    return SISGRPOConfig(**{**base, **overrides})


def _trainer(tokenizer: PreTrainedTokenizerBase, cfg: SISGRPOConfig) -> SISGRPOTrainer:
    return SISGRPOTrainer(
        model=build_tiny_policy(tokenizer),
        reward_funcs=length_reward,
        args=cfg,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        processing_class=tokenizer,
    )


def test_three_steps_accept_all_then_fewer(tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    # Micro-batches of 2, two per step: TRL shuffles each generation of 4 and splits it in two. Generation at
    # step 0 (steps 0 and 1 reuse it) and at step 2: steps 0 and 2 are first iterations, step 1 a second one.
    cfg = _config(tmp_path, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = _trainer(tokenizer, cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "sis/accept_rate" in h]
    assert len(logs) == 3
    accept = [h["sis/accept_rate"] for h in logs]
    assert accept[0] == 1.0 and accept[2] == 1.0, accept
    assert accept[1] < 1.0, accept
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert all(0.0 <= h["sis/xi_k"] <= 1.0 and h["sis/D_sis"] <= h["sis/D"] + 1e-6 for h in logs)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "no parameter changed"


@pytest.mark.parametrize(
    ("loss_type", "level"),
    [("grpo", "token"), ("bnpo", "token"), ("dr_grpo", "token"), ("dapo", "token"), ("grpo", "sequence")],
)
def test_all_accepted_equals_trl_loss(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path, loss_type: str, level: str
) -> None:
    # Before any update pi = q, so SIS accepts every token (ratio exp(logp - sg(logp)) = 1, on-policy
    # gradient) and TRL's ratio exp(logp - old_logp) is 1 too: value and gradient of the two losses must
    # agree.
    trainer = _trainer(tokenizer, _config(tmp_path, loss_type=loss_type, importance_sampling_level=level))
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions([{"prompt": PROMPTS[1]} for _ in range(4)])
    assert batch["sis_topk_ids"].shape == (*batch["completion_ids"].shape, K)
    assert batch["advantages"].abs().sum() > 0

    def loss_and_grads(loss_fn: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = loss_fn(trainer, model, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    sis_loss, sis_grads = loss_and_grads(SISGRPOTrainer._compute_loss)
    assert trainer._metrics["train"]["sis/accept_rate"][-1] == 1.0
    trl_loss, trl_grads = loss_and_grads(GRPOTrainer._compute_loss)
    torch.testing.assert_close(sis_loss, trl_loss, rtol=1e-5, atol=1e-7)
    assert len(sis_grads) == len(trl_grads) > 0
    for a, b in zip(sis_grads, trl_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_sampled_first_takes_the_sampled_token_not_rank_one() -> None:
    # Two tokens; K = 2. Token 0: sampled id 7 is rank 2 (inside the top-2). Token 1: sampled id 9 is outside
    # the top-2, so vLLM appends it as a third entry (rank 40).
    logprobs = [[[-0.5, -1.0], [-0.2, -2.0, -6.0]]]
    ids = [[[3, 7], [4, 5, 9]]]
    first_lp, first_ids, top_ids, top_lp = sampled_first(logprobs, ids, [[7, 9]], k=2)
    assert first_ids == [[[7, 3], [9, 4, 5]]]
    assert first_lp == [[[-1.0, -0.5], [-6.0, -0.2, -2.0]]]
    assert top_ids == [[[3, 7], [4, 5]]]
    assert top_lp == [[[-0.5, -1.0], [-0.2, -2.0]]]


def test_sampled_first_pads_short_lists_and_maps_nan() -> None:
    _, _, top_ids, top_lp = sampled_first([[[-0.1, None]]], [[[1, 2]]], [[1]], k=3)
    assert top_ids == [[[1, 2, 0]]]
    assert top_lp == [[[-0.1, math.inf, math.inf]]]  # log q = +inf: never the max of log pi - log q


def test_config_turns_trl_is_correction_off_and_validates(tmp_path: Path) -> None:
    assert _config(tmp_path).vllm_importance_sampling_correction is False
    assert _config(tmp_path, sis_strategy="off").vllm_importance_sampling_correction is True
    with pytest.raises(ValueError, match="sis_strategy"):
        _config(tmp_path, sis_strategy="bogus")
    with pytest.raises(ValueError, match="beta"):
        _config(tmp_path, beta=0.04)
    with pytest.raises(ValueError, match="loss_type 'cispo'"):
        _config(tmp_path, loss_type="cispo")
    with pytest.raises(ValueError, match="sis_k"):
        _config(tmp_path, sis_k=0)


def test_vllm_outputs_become_padded_sis_fields(tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    # TRL's `VLLMGeneration.generate` output with logprobs=K=2 (rank order, sampled token appended when
    # outside the top 2); the wrapper must hand TRL the sampled token's log-prob first and keep q's top-K for
    # the loss.
    trainer = _trainer(tokenizer, _config(tmp_path, sis_k=2, top_k=0))
    completions = [[7, 9], [4]]
    logprobs = [[[-0.5, -1.0], [-0.2, -2.0, -6.0]], [[-0.3, -1.5]]]
    token_ids = [[[3, 7], [4, 5, 9]], [[4, 8]]]

    def vllm_generate(**_: Any) -> tuple[Any, ...]:
        return [[1, 2], [1, 2]], completions, logprobs, token_ids

    _, _, first_lp, first_ids = trainer._wrap_vllm_generate(vllm_generate)()
    assert [[t[0] for t in seq] for seq in first_lp] == [[-1.0, -6.0], [-0.3]]
    assert [[t[0] for t in seq] for seq in first_ids] == completions
    trainer.use_vllm = True
    fields = trainer._behaviour_fields({"completion_ids": torch.tensor([[7, 9], [4, 2]])})
    torch.testing.assert_close(fields["sis_logq"], torch.tensor([[-1.0, -6.0], [-0.3, 0.0]]))
    assert fields["sis_topk_ids"].tolist() == [[[3, 7], [4, 5]], [[4, 8], [0, 0]]]
    expected = torch.tensor([[[-0.5, -1.0], [-0.2, -2.0]], [[-0.3, -1.5], [math.inf, math.inf]]])
    torch.testing.assert_close(fields["sis_topk_logq"], expected)
