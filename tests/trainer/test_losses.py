"""Policy losses, ratio strategies and aggregation: hand-derived values, registry, GSPO with SIS."""

from __future__ import annotations

import math

import pytest
import torch
from sisrl.trainer.losses import (
    aggregate,
    compute_log_ratio,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    register_policy_loss,
)
from sisrl.trainer.sis import behaviour_topk, ratio_metrics, token_and_topk_logprobs, token_in_topk


def test_clip_hand_derived() -> None:
    # ratio e, A = 1, eps 0.2: clipped to 1.2, loss -1.2. ratio e^-1, A = -1: max(e^-1, 0.8) = 0.8.
    log_ratio = torch.tensor([[1.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = get_policy_loss("grpo")(log_ratio=log_ratio, advantages=adv, mask=torch.ones(1, 2))
    assert math.isclose(loss.item(), (-1.2 + 0.8) / 2, abs_tol=1e-6)
    assert m["loss/clipfrac"].item() == 1.0


def test_clip_higher_and_dual_clip() -> None:
    # DAPO eps_high 0.28: ratio e, A = 1 -> -1.28. Dual clip c = 3, ratio e^2, A = -1: min(e^2, 3) = 3.
    loss, _ = get_policy_loss("dapo")(log_ratio=torch.tensor([[1.0]]), advantages=torch.tensor([1.0]),
                                      mask=torch.ones(1, 1))
    assert math.isclose(loss.item(), -1.28, abs_tol=1e-6)
    loss, _ = get_policy_loss("grpo")(log_ratio=torch.tensor([[2.0]]), advantages=torch.tensor([-1.0]),
                                      mask=torch.ones(1, 1), clip_dual=3.0)
    assert math.isclose(loss.item(), 3.0, abs_tol=1e-6)
    loss, _ = get_policy_loss("grpo")(log_ratio=torch.tensor([[2.0]]), advantages=torch.tensor([-1.0]),
                                      mask=torch.ones(1, 1))
    assert math.isclose(loss.item(), math.exp(2.0), rel_tol=1e-6)


def test_noclip_is_plain_surrogate() -> None:
    loss, _ = get_policy_loss("grpo_noclip")(log_ratio=torch.tensor([[1.0, 0.0]]),
                                             advantages=torch.tensor([2.0]), mask=torch.ones(1, 2))
    assert math.isclose(loss.item(), -(2 * math.e + 2) / 2, rel_tol=1e-6)


def test_aggregation_modes_hand_computed() -> None:
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # token-mean (1+2+4)/3; seq-mean-token-mean ((1+2)/2 + 4/1)/2; token-sum (3+4)/2; norm (3+4)/2/3
    assert math.isclose(aggregate(loss_mat, mask, "token-mean").item(), 7 / 3, rel_tol=1e-6)
    assert math.isclose(aggregate(loss_mat, mask, "seq-mean-token-mean").item(), 2.75, rel_tol=1e-6)
    assert math.isclose(aggregate(loss_mat, mask, "seq-mean-token-sum").item(), 3.5, rel_tol=1e-6)
    assert math.isclose(aggregate(loss_mat, mask, "seq-mean-token-sum-norm").item(), 3.5 / 3, rel_tol=1e-6)
    # Two ranks with 3 + 5 tokens: each divides by the global 8 and multiplies by 2 for DDP's mean.
    assert math.isclose(aggregate(loss_mat, mask, "token-mean", global_tokens=8, dp_size=2).item(), 7 * 2 / 8)
    with pytest.raises(ValueError, match="'bogus'.*token-mean"):
        aggregate(loss_mat, mask, "bogus")


def test_masked_values_do_not_leak_into_aggregation() -> None:
    loss_mat = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert torch.isfinite(aggregate(loss_mat, mask, mode)), mode


def test_registry_refuses_unknown_and_duplicate_names() -> None:
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*'gspo'"):
        get_policy_loss("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("grpo")(get_policy_loss("grpo"))


def test_ratio_strategies_hand_derived() -> None:
    logp = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    logq = torch.tensor([[-2.0, 0.0, 1.0]])  # w = e^2, 1, e^-1
    mask = torch.ones(1, 3)
    plain = compute_log_ratio("is", logp=logp, logq=logq, mask=mask)
    torch.testing.assert_close(plain.log_ratio, torch.tensor([[2.0, 0.0, -1.0]]))
    tis = compute_log_ratio("tis", logp=logp, logq=logq, mask=mask, tis_cap=2.0)
    torch.testing.assert_close(tis.log_ratio.exp(), torch.tensor([[2.0, 1.0, math.exp(-1)]]))
    assert math.isclose(tis.metrics["tis/truncated_frac"].item(), 1 / 3, rel_tol=1e-6)
    # Truncated token keeps gradient C * grad log pi: d(r)/d(logp) = r = 2 at the cap.
    (grad,) = torch.autograd.grad(tis.log_ratio.exp().sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[2.0, 1.0, math.exp(-1)]]))
    ice = compute_log_ratio("icepop", logp=logp, logq=logq, mask=mask, icepop_low=0.5, icepop_high=2.0)
    assert ice.weights is not None
    torch.testing.assert_close(ice.weights, torch.tensor([[0.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="unknown ratio strategy 'xx'"):
        compute_log_ratio("xx", logp=logp, logq=logq, mask=mask)
    with pytest.raises(ValueError, match="needs topk_logp"):
        compute_log_ratio("sis", logp=logp, logq=logq, mask=mask)


def test_icepop_weights_zero_the_gradient_of_out_of_range_tokens() -> None:
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    res = compute_log_ratio("icepop", logp=logp, logq=torch.tensor([[-3.0, 0.0]]), mask=torch.ones(1, 2))
    loss, _ = get_policy_loss("grpo")(log_ratio=res.log_ratio, advantages=torch.tensor([1.0]),
                                      mask=torch.ones(1, 2), weights=res.weights)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0] == 0 and grad[0, 1] != 0


def test_none_ratio_is_one_with_the_on_policy_gradient() -> None:
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    res = compute_log_ratio("none", logp=logp, logq=torch.tensor([[-3.0, 0.0]]), mask=torch.ones(1, 2))
    torch.testing.assert_close(res.log_ratio.exp(), torch.ones(1, 2))
    (grad,) = torch.autograd.grad(res.log_ratio.exp().sum(), logp)
    torch.testing.assert_close(grad, torch.ones(1, 2))  # d exp(logp - sg(logp)) / d logp = 1: grad log pi


@pytest.mark.parametrize(("mode", "kept"), [("sequence", [1.0, 0.0, 0.0]), ("geometric", [1.0, 1.0, 0.0])])
def test_seqmask_masks_whole_sequences_outside_the_bounds(mode: str, kept: list[float]) -> None:
    # sequence log-ratios: row 0 sum 0.4 (mean 0.2); row 1 sum 1.2 over 3 tokens (mean 0.4); row 2 sum -1.6 over
    # 2 tokens (mean -0.8); bounds [0.5, 2] in ratio = [-0.693, 0.693] in log; the padding of row 2 counts nowhere
    logq = torch.tensor([[-0.2, -0.2, 0.0], [-0.4, -0.4, -0.4], [0.8, 0.8, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    res = compute_log_ratio("seqmask", logp=torch.zeros(3, 3), logq=logq, mask=mask, seqmask_mode=mode,
                            seqmask_high=2.0)
    assert res.weights is not None
    torch.testing.assert_close(res.weights[:, 0], torch.tensor(kept))
    assert math.isclose(res.metrics["seqmask/masked_seq_frac"].item(), 1 - sum(kept) / 3, rel_tol=1e-6)
    with pytest.raises(ValueError, match="seqmask bounds"):
        compute_log_ratio("seqmask", logp=torch.zeros(1, 1), logq=torch.zeros(1, 1), mask=torch.ones(1, 1),
                          seqmask_low=3.0, seqmask_high=2.0)


def test_ratio_ess_is_kish_share() -> None:
    log_ratio = torch.log(torch.tensor([[1.0, 1.0, 4.0, 9.0]]))
    mask = torch.tensor([[True, True, True, False]])
    ess = ratio_metrics(log_ratio, mask)["sis/ratio_ess"].item()
    assert math.isclose(ess, (6 / 3) ** 2 / (18 / 3), rel_tol=1e-6)  # (mean r)^2 / mean r^2 over 1, 1, 4


def _sis_batch(seed: int):
    torch.manual_seed(seed)
    logits = torch.randn(3, 8, 30, requires_grad=True)
    logits_q = logits.detach() + 0.7 * torch.randn(3, 8, 30)
    y = torch.distributions.Categorical(logits=logits_q).sample()
    logq, topk_ids, topk_logq = behaviour_topk(logits_q, y, 10)
    logp, topk_logp = token_and_topk_logprobs(logits, y, topk_ids)
    mask = torch.ones(3, 8)
    mask[2, 5:] = 0
    res = compute_log_ratio("sis", logp=logp, logq=logq, mask=mask, topk_logp=topk_logp, topk_logq=topk_logq,
                            in_topk=token_in_topk(y, topk_ids), generator=torch.Generator().manual_seed(seed))
    return logits, logp, logq, mask, res


def test_gspo_sequence_ratio_and_sis_zeroes_accepted_tokens() -> None:
    """s_i = exp(mean over the sequence's policy tokens of log r_t), log r_t = 0 for SIS-accepted tokens.

    Hand-built batch, B = 2, T = 3, K = 2 (probabilities written out; l_t = log pi(y_t) - log q(y_t)):
      seq 0, t0: y in V_K, pi/q on V_K = (0.5/0.25, 0.25/0.5) = (2, 0.5), so M = 2 = w: accepted for every u.
      seq 0, t1: y outside V_K: rejected, l = log(0.1 / 0.2) = -log 2.
      seq 0, t2: masked (l = log 100 would move every figure below if it counted).
      seq 1: y outside V_K at all three tokens: l = log 2, log 2, -log 2.
    SIS: s_0 = exp((0 - log 2) / 2) = 2^-1/2 = 0.70711, s_1 = exp((log 2) / 3) = 2^1/3 = 1.25992,
         mean 0.98351; accept rate 1 accepted / 5 policy tokens = 0.2.
    IS:  s_0 = exp((log 2 - log 2) / 2) = 1, s_1 = 2^1/3, mean 1.12996.
    """
    ln = math.log
    logp = torch.tensor([[ln(0.5), ln(0.1), 0.0], [ln(0.4), ln(0.4), ln(0.1)]])
    logq = torch.tensor([[ln(0.25), ln(0.2), ln(0.01)], [ln(0.2), ln(0.2), ln(0.2)]])
    topk_logp = torch.tensor([[[ln(0.5), ln(0.25)], [ln(0.4), ln(0.3)], [ln(0.4), ln(0.3)]]] * 2)
    topk_logq = torch.tensor([[[ln(0.25), ln(0.5)], [ln(0.4), ln(0.3)], [ln(0.4), ln(0.3)]]] * 2)
    in_topk = torch.tensor([[True, False, False], [False, False, False]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    res = compute_log_ratio("sis", logp=logp, logq=logq, mask=mask, topk_logp=topk_logp, topk_logq=topk_logq,
                            in_topk=in_topk, generator=torch.Generator().manual_seed(0))
    assert res.metrics["sis/accept_rate"].item() == pytest.approx(0.2, abs=1e-7)
    _, metrics = get_policy_loss("gspo")(log_ratio=res.log_ratio, advantages=adv, mask=mask)
    expect = (2 ** -0.5 + 2 ** (1 / 3)) / 2
    assert metrics["gspo/seq_ratio_mean"].item() == pytest.approx(expect, rel=1e-6)
    plain = compute_log_ratio("is", logp=logp, logq=logq, mask=mask)
    _, plain_metrics = get_policy_loss("gspo")(log_ratio=plain.log_ratio, advantages=adv, mask=mask)
    assert plain_metrics["gspo/seq_ratio_mean"].item() == pytest.approx((1 + 2 ** (1 / 3)) / 2, rel=1e-6)


def test_gspo_gradient_is_sequence_ratio_times_grad_logp() -> None:
    """Unclipped GSPO: dL/dlogp_t = -(A_i / B) sg(s_i) / |y_i| (seq-mean-token-mean)."""
    logits, logp, logq, mask, res = _sis_batch(1)
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, _ = get_policy_loss("gspo")(log_ratio=res.log_ratio, advantages=adv, mask=mask, clip_low=10.0,
                                      clip_high=10.0)
    (grad,) = torch.autograd.grad(loss, logp)
    n = mask.sum(-1)
    s = ((res.log_ratio.detach() * mask).sum(-1) / n).exp()
    expect = (-(adv * s / n / 3)).unsqueeze(-1) * mask
    torch.testing.assert_close(grad, expect, rtol=1e-5, atol=1e-7)


def test_kl_penalties_hand_derived() -> None:
    logp, ref = torch.tensor([0.0]), torch.tensor([-1.0])
    assert kl_penalty(logp, ref, "k1").item() == 1.0
    assert kl_penalty(logp, ref, "k2").item() == 0.5
    assert math.isclose(kl_penalty(logp, ref, "low_var_kl").item(), math.exp(-1) + 1 - 1, rel_tol=1e-6)
    with pytest.raises(ValueError, match="'k9'"):
        kl_penalty(logp, ref, "k9")


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_entropy_matches_definition(chunk_size: int | None) -> None:
    logits = torch.randn(2, 5, 40) * 3
    p = torch.softmax(logits, -1)
    ref = -(p * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size), ref, rtol=1e-5, atol=1e-5)
