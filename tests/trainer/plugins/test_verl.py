"""verl plug-in: the registered SIS losses called through verl's own registry, and the actor-side extension
fed through verl's own padding helpers and `ppo_loss`. verl's FSDP engine only registers for CUDA/NPU devices,
so no
actor update runs here (see docs/plugins.md for the GPU recipe)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip(
    "verl",
    reason="verl is not installed: pip install --no-deps verl==0.9.1; "
    "pip install ray 'tensordict>=0.8,<=0.10.0,!=0.9.0' omegaconf codetiming orjson",
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sisrl.trainer.plugins.verl as sis_verl  # noqa: E402
from sisrl.common.models import build_tiny_policy, load_tokenizer  # noqa: E402
from sisrl.trainer.losses import compute_log_ratio, get_policy_loss  # noqa: E402
from sisrl.trainer.sis import behaviour_topk, token_and_topk_logprobs, token_in_topk  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

B, T, K, V = 4, 6, 5, 11
SEED = 3


def _config(clip_high: float = 0.28, loss_mode: str = "vanilla", **batch_info: Any) -> Any:
    cfg = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=2,
        ppo_mini_batch_size=2,
        clip_ratio_low=0.2,
        clip_ratio_high=clip_high,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    cfg.global_batch_info.update(batch_info)
    return cfg


def _tensors(seed: int, accept_all: bool) -> dict[str, torch.Tensor]:
    """Random log-probs over a vocabulary of V; with accept_all, pi = q (ratio 1, M = 1) and y_t in V_K."""
    g = torch.Generator().manual_seed(seed)
    logits_p = torch.randn(B, T, V, generator=g)
    logits_q = logits_p if accept_all else logits_p + 0.5 * torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logq, topk_ids, topk_logq = behaviour_topk(logits_q, tokens, K)
    if accept_all:
        tokens = topk_ids[..., 0]  # a token of V_K, so the accept test sees it
        logq, topk_ids, topk_logq = behaviour_topk(logits_q, tokens, K)
    leaf = logits_p.clone().requires_grad_(True)
    logp, topk_logp = token_and_topk_logprobs(leaf, tokens, topk_ids)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return {
        "leaf": leaf,
        "logp": logp,
        "logq": logq,
        "topk_logp": topk_logp,
        "topk_logq": topk_logq,
        "in_topk": token_in_topk(tokens, topk_ids),
        "mask": mask,
        "adv": torch.randn(B, T, generator=g),
    }


def _call(
    name: str, x: dict[str, torch.Tensor], old: torch.Tensor, agg: str, cfg: Any
) -> tuple[torch.Tensor, Any]:
    x["leaf"].grad = None
    tokens = sis_verl.SISTokens(x["topk_logp"], x["topk_logq"], x["in_topk"])
    with sis_verl.sis_tokens(tokens):
        loss, metrics = get_policy_loss_fn(name)(
            old_log_prob=old,
            log_prob=x["logp"],
            advantages=x["adv"],
            response_mask=x["mask"],
            loss_agg_mode=agg,
            config=cfg,
            rollout_is_weights=None,
        )
    (grad,) = torch.autograd.grad(loss, x["leaf"], retain_graph=True)
    return loss.detach(), (grad, metrics)


@pytest.fixture(autouse=True)
def _fresh_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SISRL_SIS_SEED", str(SEED))
    monkeypatch.delenv("RANK", raising=False)
    sis_verl._GENERATORS.clear()


@pytest.mark.parametrize(("name", "ours"), [("sis", "grpo"), ("sis_gspo", "gspo")])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_registered_loss_equals_sisrl_loss(name: str, ours: str, agg: str) -> None:
    x = _tensors(0, accept_all=False)
    cfg = _config()
    loss, (grad, metrics) = _call(name, x, x["logq"], agg, cfg)
    ratio = compute_log_ratio(
        "sis",
        logp=x["logp"],
        logq=x["logq"],
        mask=x["mask"],
        topk_logp=x["topk_logp"],
        topk_logq=x["topk_logq"],
        in_topk=x["in_topk"],
        generator=torch.Generator().manual_seed(SEED),
    )
    expected, _ = get_policy_loss(ours)(
        log_ratio=ratio.log_ratio,
        advantages=x["adv"],
        mask=x["mask"],
        agg_mode=agg,
        clip_low=0.2,
        clip_high=0.28,
        clip_dual=3.0 if ours == "grpo" else None,
    )
    (expected_grad,) = torch.autograd.grad(expected, x["leaf"])
    assert 0.0 < float(metrics["sis/accept_rate"]) < 1.0  # a mixed case: some tokens accepted, some rejected
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(("name", "verl_name"), [("sis", "vanilla"), ("sis_gspo", "gspo")])
@pytest.mark.parametrize(
    ("agg", "info"),
    [
        ("token-mean", {}),
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 40}),
        ("token-sum", {"dp_size": 2}),
        ("seq-mean-token-mean", {"dp_size": 1, "global_batch_size": 8}),
        ("seq-mean-token-sum", {}),
        ("seq-mean-token-sum-norm", {"global_batch_size": 8, "loss_scale_factor": 10}),
    ],
)
def test_all_accepted_equals_verl_loss(name: str, verl_name: str, agg: str, info: dict[str, Any]) -> None:
    # pi = q: SIS accepts every token (ratio exp(logp - sg(logp)) = 1); verl's ratio exp(logp - old) is 1 as
    # well, so value and gradient must match verl's own loss under every aggregation and global-batch
    # normalisation.
    x = _tensors(1, accept_all=True)
    cfg = _config(**info)
    loss, (grad, metrics) = _call(name, x, x["logp"].detach(), agg, cfg)
    assert float(metrics["sis/accept_rate"]) == 1.0
    ref_loss, (ref_grad, _) = _call(verl_name, x, x["logp"].detach(), agg, cfg)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)


def test_loss_refuses_rollout_is_weights_and_missing_topk() -> None:
    x = _tensors(2, accept_all=False)
    with pytest.raises(RuntimeError, match="top-K"):
        get_policy_loss_fn("sis")(x["logq"], x["logp"], x["adv"], x["mask"], "token-mean", _config(), None)
    with sis_verl.sis_tokens(sis_verl.SISTokens(x["topk_logp"], x["topk_logq"], x["in_topk"])):
        with pytest.raises(ValueError, match="rollout_is"):
            get_policy_loss_fn("sis")(
                x["logq"], x["logp"], x["adv"], x["mask"], "token-mean", _config(), x["mask"]
            )


def _padded_batch(prompts: list[list[int]], responses: list[list[int]], k: int) -> dict[str, torch.Tensor]:
    """verl's padded layout: prompts left-padded to P, responses right-padded to R (pad id 0)."""
    p_w, r_w = max(map(len, prompts)), max(map(len, responses))
    n = len(prompts)
    prompt_ids, response_ids = torch.zeros(n, p_w, dtype=torch.long), torch.zeros(n, r_w, dtype=torch.long)
    attention = torch.zeros(n, p_w + r_w, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, p_w - len(p) :] = torch.tensor(p)
        response_ids[i, : len(r)] = torch.tensor(r)
        attention[i, p_w - len(p) : p_w + len(r)] = 1
    return {
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": torch.cat([prompt_ids, response_ids], 1),
        "attention_mask": attention,
        "response_mask": attention[:, p_w:].clone(),
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
    }


@pytest.mark.parametrize("as_lists", [False, True])
def test_actor_extension_through_verl_padding_and_ppo_loss(as_lists: bool) -> None:
    # A tiny Llama scores each sequence unpadded, as verl's engine does after removing padding: the
    # extension's logits-processor half gathers pi at q's top-K, verl nests the outputs, and its `ppo_loss`
    # calls `sis`. as_lists: the top-K arrive as per-sequence [T_i][K] lists, as the rollout server's
    # extra_fields do.
    model = build_tiny_policy(load_tokenizer(), seed=1).float()
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21, 22, 23], [24, 25], [26, 27, 28]]
    padded = _padded_batch(prompts, responses, K)
    seqs = [torch.tensor(p + r) for p, r in zip(prompts, responses, strict=True)]
    with torch.no_grad():
        behaviour = [
            model(s[None]).logits[0] + 0.3 * torch.randn(len(s), model.config.vocab_size) for s in seqs
        ]
    # q per response token: logits at the position before each response token (shift by one).
    r_w = padded["responses"].shape[1]
    q_logits = torch.zeros(len(seqs), r_w, model.config.vocab_size)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        q_logits[i, : len(r)] = behaviour[i][len(p) - 1 : len(p) + len(r) - 1]
    logq, topk_ids, topk_logq = behaviour_topk(q_logits, padded["responses"], K)
    n = len(seqs)
    g = torch.Generator().manual_seed(4)
    advantages = torch.randn(n, 1, generator=g).expand(n, r_w).contiguous()
    batch = TensorDict({**padded, "old_log_probs": logq, "advantages": advantages}, batch_size=n)
    if as_lists:
        lens = [len(r) for r in responses]
        tu.assign_non_tensor(
            batch,
            sis_topk_ids=[topk_ids[i, :m].tolist() for i, m in enumerate(lens)],
            sis_topk_logq=[topk_logq[i, :m].tolist() for i, m in enumerate(lens)],
        )
    else:
        batch["sis_topk_ids"], batch["sis_topk_logq"] = topk_ids, topk_logq
    data = left_right_2_no_padding(batch)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    cfg = _config(loss_mode="sis")

    # [N, V] packed logits; the gradient flows to the model
    logits_rmpad = torch.cat([model(s[None]).logits[0] for s in seqs], dim=0)
    rolled = torch.roll(data["input_ids"].values(), shifts=-1)
    log_probs = torch.log_softmax(logits_rmpad, -1).gather(-1, rolled[:, None]).squeeze(-1)
    cu = data["input_ids"].offsets()
    model_output: dict[str, Any] = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, cu)}
    extra = sis_verl.sis_actor_loss(cfg, student_logits=logits_rmpad[None], data=data)
    model_output.update(
        {key: torch.nested.nested_tensor_from_jagged(v.squeeze(0), cu) for key, v in extra.items()}
    )
    loss, metrics = sis_verl.sis_actor_loss(cfg, model_output=model_output, data=data)

    # The same loss computed directly on response-padded tensors with sisrl's own functions.
    pi_logits = torch.zeros(n, r_w, model.config.vocab_size)
    full = [model(s[None]).logits[0] for s in seqs]
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        pi_logits[i, : len(r)] = full[i][len(p) - 1 : len(p) + len(r) - 1]
    logp, topk_logp = token_and_topk_logprobs(pi_logits, padded["responses"], topk_ids)
    mask = padded["response_mask"]
    ratio = compute_log_ratio(
        "sis",
        logp=logp,
        logq=logq,
        mask=mask,
        topk_logp=topk_logp,
        topk_logq=topk_logq,
        in_topk=token_in_topk(padded["responses"], topk_ids),
        generator=torch.Generator().manual_seed(SEED),
    )
    expected, _ = get_policy_loss("grpo")(
        log_ratio=ratio.log_ratio,
        advantages=advantages,
        mask=mask,
        agg_mode="token-mean",
        clip_low=0.2,
        clip_high=0.28,
        clip_dual=3.0,
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert "actor/pg_loss" in metrics and "sis/accept_rate" in metrics
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@dataclass
class _Logprob:
    """The fields of vLLM's `Logprob` that the server hook reads (vLLM is not installed here)."""

    logprob: float
    rank: int


def test_rank_topk_keeps_q_top_k_in_rank_order() -> None:
    # K = 2. Token 0: the sampled id 9 ranks 7th, so vLLM adds it as a third entry; it is not in V_K.
    positions = [
        {9: _Logprob(-5.0, 7), 4: _Logprob(-0.3, 1), 2: _Logprob(-1.9, 2)},
        {3: _Logprob(-0.1, 1), 8: _Logprob(-2.5, 2)},
    ]
    ids, logq = sis_verl.rank_topk(positions, 2)
    assert ids == [[4, 2], [3, 8]]
    assert logq == [[-0.3, -1.9], [-0.1, -2.5]]
    with pytest.raises(ValueError, match="expected K=3"):
        sis_verl.rank_topk(positions, 3)


def test_response_tensor_pads_lists_with_fill() -> None:
    out = sis_verl.response_tensor([[[1, 2]], [[3, 4], [5, 6]]], 3, 0, torch.long)
    assert out.tolist() == [[[1, 2], [0, 0], [0, 0]], [[3, 4], [5, 6], [0, 0]]]
