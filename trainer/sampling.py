"""In-process sampling with a behaviour record, and the synthetic task used by tests and bench/staleness.py.

The synthetic task needs no gateway: a prompt is a few random token ids, the policy writes
`synthetic_response_len` tokens, and the reward is the share of them that lie in a fixed target set
(ids divisible by round(1 / synthetic_target_frac)). A random policy scores about synthetic_target_frac; a
policy that learned the task scores near 1. q is recorded token by token from the KV-cached decode, so it
differs from the trainer's full forward by float rounding only (a small, real train/inference mismatch).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from sisrl.trainer.batch import Trajectory
from sisrl.trainer.config import RolloutConfig
from sisrl.trainer.data import QAItem
from sisrl.trainer.sis import behaviour_topk
from torch import Tensor, nn

PROMPT_LEN = 4


@torch.no_grad()
def sample_with_behaviour(model: nn.Module, prompt_ids: Tensor, *, new_tokens: int, temperature: float, k: int,
                          generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sample `new_tokens` tokens after equal-length prompts [B, P] with a KV cache.

    Returns response ids [B, T], log q [B, T], q's top-K ids [B, T, K] and log-probs [B, T, K], with q the
    distribution actually sampled from: softmax(logits / temperature).
    """
    out = model(input_ids=prompt_ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[:, -1:, :].float()  # [B, 1, V]
    ids, logq, top_ids, top_logq = [], [], [], []
    for _ in range(new_tokens):
        probs = torch.softmax(logits[:, 0] / temperature, dim=-1)  # [B, V]
        tok = torch.multinomial(probs, 1, generator=generator)  # [B, 1]
        lq, t_ids, t_lq = behaviour_topk(logits, tok, k, temperature)  # [B, 1], [B, 1, K], [B, 1, K]
        ids.append(tok)
        logq.append(lq)
        top_ids.append(t_ids)
        top_logq.append(t_lq)
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1:, :].float()
    return torch.cat(ids, 1), torch.cat(logq, 1), torch.cat(top_ids, 1), torch.cat(top_logq, 1)


def target_modulus(target_frac: float) -> int:
    return max(2, round(1.0 / target_frac))


class SyntheticSource:
    """Rollouts of the synthetic task from the trainer's own model (rank 0). Deterministic from (seed, step)."""

    def __init__(self, model: nn.Module, cfg: RolloutConfig, *, k: int, seed: int, vocab_size: int) -> None:
        self.model = model
        self.cfg = cfg
        self.k = k
        self.seed = seed
        self.vocab_size = vocab_size
        self.modulus = target_modulus(cfg.synthetic_target_frac)

    def rollouts(self, items: list[QAItem], step: int, version: int) -> list[Trajectory]:
        del items  # the synthetic task makes its own prompts
        rng = random.Random(f"{self.seed}:prompts:{step}")
        device = next(self.model.parameters()).device
        g = self.cfg.samples_per_prompt
        prompts = [[rng.randrange(self.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(self.cfg.prompts_per_step)]
        prompt_ids = torch.tensor([p for p in prompts for _ in range(g)], device=device)  # [B, P]
        gen = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + step)
        resp, logq, top_ids, top_logq = sample_with_behaviour(
            self.model, prompt_ids, new_tokens=self.cfg.synthetic_response_len, temperature=self.cfg.temperature,
            k=self.k, generator=gen,
        )
        rewards = (resp % self.modulus == 0).float().mean(dim=1)  # [B] share of target tokens
        trajs = []
        for i in range(prompt_ids.shape[0]):
            n = resp.shape[1]
            trajs.append(Trajectory(
                id=f"{step}-{i}", item_id=f"synthetic-{step}-{i // g}", group_id=f"{step}:{i // g}",
                data_source="synthetic", prompt_ids=prompt_ids[i].tolist(), response_ids=resp[i].tolist(),
                loss_mask=[1] * n, behaviour_logprobs=logq[i].tolist(), topk_ids=top_ids[i].tolist(),
                topk_logprobs=top_logq[i].tolist(), reward=float(rewards[i]), reward_parts={"em": float(rewards[i])},
                finish_reason="length", policy_version=version,
            ))
        return trajs

    def push_policy(self, path: Path | None, version: int) -> None:
        """Nothing to push: the next rollout samples from the same in-process model."""
        del path, version

    @property
    def needs_weights(self) -> bool:
        return False
