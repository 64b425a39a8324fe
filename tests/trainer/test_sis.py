"""SIS core: distribution of accepted tokens, pathwise bounds, gradients, masking, the log-prob gather."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from sisrl.trainer.losses import get_policy_loss
from sisrl.trainer.sis import (
    behaviour_topk,
    exact_log_m,
    gather_logprobs,
    sis_log_ratio,
    token_and_topk_logprobs,
    token_in_topk,
)

V = 50


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of integer counts to a distribution (renormalised in float64)."""
    p = probs.double() / probs.double().sum()
    return float(chisquare(counts.double().numpy(), (p * counts.sum()).numpy()).pvalue)


def _draw(pi_logits: torch.Tensor, q_logits: torch.Tensor, n: int, k: int, seed: int):
    """n independent draws y ~ q at one position each, run through the SIS test with q's top-k."""
    gen = torch.Generator().manual_seed(seed)
    logq_full = torch.log_softmax(q_logits, -1)
    logp_full = torch.log_softmax(pi_logits, -1)
    y = torch.multinomial(logq_full.exp(), n, replacement=True, generator=gen)  # [n]
    topk_ids = logq_full.topk(k).indices  # [k]
    ids = topk_ids.expand(n, 1, k)
    res = sis_log_ratio(
        logp=logp_full[y].unsqueeze(1),
        logq=logq_full[y].unsqueeze(1),
        topk_logp=logp_full[ids],
        topk_logq=logq_full[ids],
        in_topk=token_in_topk(y.unsqueeze(1), ids),
        mask=torch.ones(n, 1),
        generator=gen,
    )
    return y, res.accepted.squeeze(1), res, topk_ids, logp_full.exp()


def test_exact_mode_accepted_tokens_follow_pi() -> None:
    torch.manual_seed(0)
    pi_logits, q_logits = torch.randn(V) * 1.5, torch.randn(V) * 1.5
    y, acc, _, _, pi = _draw(pi_logits, q_logits, n=200_000, k=V, seed=1)
    counts = torch.bincount(y[acc], minlength=V).double()
    assert counts.sum() > 5_000  # enough accepted draws for the test to have power
    assert _chi2_pvalue(counts, pi) > 1e-3


def test_exact_mode_detects_a_wrong_target() -> None:
    """The chi-square test above has power: the same draws do not fit q."""
    torch.manual_seed(0)
    pi_logits, q_logits = torch.randn(V) * 1.5, torch.randn(V) * 1.5
    y, acc, _, _, _ = _draw(pi_logits, q_logits, n=200_000, k=V, seed=1)
    counts = torch.bincount(y[acc], minlength=V).double()
    assert _chi2_pvalue(counts, torch.softmax(q_logits, -1)) < 1e-6


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_exact_log_m_gives_the_decisions_of_top_k_at_k_equal_v(chunk_size: int | None) -> None:
    """`log_m` from the two full distributions (no [B, T, V] id tensor) decides as the top-K path with K = V."""
    torch.manual_seed(3)
    logits_q = torch.randn(2, 7, V)
    logits_p = logits_q + 0.3 * torch.randn(2, 7, V)
    y = torch.distributions.Categorical(logits=logits_q).sample()
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0
    logq, topk_ids, topk_logq = behaviour_topk(logits_q, y, V)
    logp, topk_logp = token_and_topk_logprobs(logits_p, y, topk_ids)
    full = sis_log_ratio(logp=logp, logq=logq, topk_logp=topk_logp, topk_logq=topk_logq,
                         in_topk=token_in_topk(y, topk_ids), mask=mask, generator=torch.Generator().manual_seed(0))
    log_m = exact_log_m(logits_p, logits_q, chunk_size=chunk_size)
    exact = sis_log_ratio(logp=logp, logq=logq, topk_logp=topk_logp[..., :1], topk_logq=topk_logq[..., :1],
                          in_topk=torch.zeros_like(y, dtype=torch.bool), mask=mask,
                          generator=torch.Generator().manual_seed(0), log_m=log_m)
    torch.testing.assert_close(exact.log_m, full.log_m)
    assert torch.equal(exact.accepted, full.accepted) and exact.accepted.any() and not exact.accepted.all()
    torch.testing.assert_close(exact.log_ratio, full.log_ratio)
    assert exact.metrics["sis/xi_k"].item() == 0.0


def test_topk_mode_follows_pi_restricted_and_tv_matches_xi() -> None:
    torch.manual_seed(3)
    pi_logits, q_logits = torch.randn(V) * 2.0, torch.randn(V) * 2.0
    k = 10
    y, acc, res, topk_ids, pi = _draw(pi_logits, q_logits, n=400_000, k=k, seed=4)
    counts = torch.bincount(y[acc], minlength=V).double()
    outside = torch.ones(V, dtype=torch.bool)
    outside[topk_ids] = False
    assert counts[outside].sum() == 0  # tokens outside V_K are always rejected
    n_acc = counts.sum()
    assert _chi2_pvalue(counts[topk_ids], pi[topk_ids]) > 1e-3
    xi = 1.0 - pi.double()[topk_ids].sum()
    tv = 0.5 * (counts / n_acc - pi.double()).abs().sum()
    # Empirical TV is biased up by ~ sum_v sqrt(p_v / (2 pi n)); 0.01 is > 5 sigma at this n, far below xi.
    assert xi > 0.05
    assert abs(tv - xi) < 0.01
    assert torch.isclose(res.metrics["sis/xi_k"].double(), xi, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 4),
    t=st.integers(1, 12),
    k=st.integers(1, 8),
    scale=st.floats(0.1, 5.0),
)
def test_d_sis_never_exceeds_d(seed: int, b: int, t: int, k: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits_p = torch.randn(b, t, 16, generator=gen) * scale
    logits_q = torch.randn(b, t, 16, generator=gen) * scale
    y = torch.randint(0, 16, (b, t), generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.3).float()
    logq, topk_ids, topk_logq = behaviour_topk(logits_q, y, k)
    logp, topk_logp = token_and_topk_logprobs(logits_p, y, topk_ids)
    res = sis_log_ratio(
        logp=logp, logq=logq, topk_logp=topk_logp, topk_logq=topk_logq,
        in_topk=token_in_topk(y, topk_ids), mask=mask, generator=gen,
    )
    assert res.metrics["sis/D_sis"] <= res.metrics["sis/D"] + 1e-6
    assert 0.0 <= res.metrics["sis/accept_rate"] <= 1.0
    assert not res.accepted[mask == 0].any()


def test_accept_decisions_match_a_per_token_loop() -> None:
    """Vectorised test vs the definition token by token, with the same uniforms."""
    gen = torch.Generator().manual_seed(7)
    b, t, k = 4, 16, 8
    logits_p, logits_q = torch.randn(b, t, 12), torch.randn(b, t, 12)
    y = torch.randint(0, 12, (b, t))
    logq, topk_ids, topk_logq = behaviour_topk(logits_q, y, k)
    logp, topk_logp = token_and_topk_logprobs(logits_p, y, topk_ids)
    res = sis_log_ratio(
        logp=logp, logq=logq, topk_logp=topk_logp, topk_logq=topk_logq,
        in_topk=token_in_topk(y, topk_ids), mask=torch.ones(b, t), generator=torch.Generator().manual_seed(7),
    )
    u = torch.rand(b, t, generator=gen)
    pi, q = torch.softmax(logits_p, -1), torch.softmax(logits_q, -1)
    for i in range(b):
        for j in range(t):
            top = topk_ids[i, j].tolist()
            m = max(pi[i, j, v] / q[i, j, v] for v in top)
            w = pi[i, j, y[i, j]] / q[i, j, y[i, j]]
            expect = y[i, j].item() in top and u[i, j] <= w / m
            assert bool(res.accepted[i, j]) == bool(expect), (i, j)
            assert math.isclose(res.log_m[i, j].item(), math.log(m), rel_tol=1e-5, abs_tol=1e-5)


def _grad_setup(seed: int = 0):
    torch.manual_seed(seed)
    b, t, vocab, k = 2, 6, 20, 5
    logits = torch.randn(b, t, vocab, requires_grad=True)
    logits_q = logits.detach() + 0.8 * torch.randn(b, t, vocab)
    y = torch.randint(0, vocab, (b, t))
    logq, topk_ids, topk_logq = behaviour_topk(logits_q, y, k)
    y = torch.where(torch.rand(b, t) < 0.7, topk_ids[..., 0], y)  # most tokens inside V_K
    logq, topk_ids, topk_logq = behaviour_topk(logits_q, y, k)
    mask = torch.ones(b, t)
    mask[1, -2:] = 0
    return logits, y, logq, topk_ids, topk_logq, mask


def test_gradients_accepted_rejected_and_masked() -> None:
    logits, y, logq, topk_ids, topk_logq, mask = _grad_setup()
    logp, topk_logp = token_and_topk_logprobs(logits, y, topk_ids)
    res = sis_log_ratio(
        logp=logp, logq=logq, topk_logp=topk_logp, topk_logq=topk_logq,
        in_topk=token_in_topk(y, topk_ids), mask=mask, generator=torch.Generator().manual_seed(1),
    )
    adv = torch.tensor([0.7, -1.3])
    loss, _ = get_policy_loss("grpo")(
        log_ratio=res.log_ratio, advantages=adv, mask=mask, clip_low=100.0, clip_high=100.0,
        agg_mode="seq-mean-token-sum",
    )
    loss.backward()
    assert res.accepted.any() and (~res.accepted & mask.bool()).any()  # both kinds present
    n_seq = 2
    for i in range(2):
        for j in range(6):
            g = logits.grad[i, j]
            if mask[i, j] == 0:
                assert torch.equal(g, torch.zeros_like(g))
                continue
            lp_grad = torch.autograd.grad(gather_logprobs(logits, y)[i, j], logits)[0][i, j]
            ratio = 1.0 if res.accepted[i, j] else math.exp((logp[i, j] - logq[i, j]).item())
            # loss = -(1/B) sum A r_t  =>  dL/dlogits = -(A / B) r_t grad log pi(y_t)
            torch.testing.assert_close(g, -adv[i] / n_seq * ratio * lp_grad, rtol=1e-5, atol=1e-7)


def test_pi_equals_q_accepts_all_of_vk_and_matches_plain_loss() -> None:
    logits, y, _, _, _, mask = _grad_setup(seed=2)
    logq, topk_ids, topk_logq = behaviour_topk(logits.detach(), y, 5)
    in_topk = token_in_topk(y, topk_ids)
    adv = torch.tensor([1.0, -0.5])
    grads, values = [], []
    for strategy in ("sis", "is"):
        logits.grad = None
        logp, topk_logp = token_and_topk_logprobs(logits, y, topk_ids)
        if strategy == "sis":
            res = sis_log_ratio(
                logp=logp, logq=logq, topk_logp=topk_logp, topk_logq=topk_logq, in_topk=in_topk, mask=mask,
                generator=torch.Generator().manual_seed(0),
            )
            assert torch.equal(res.accepted, in_topk & mask.bool())
            log_ratio = res.log_ratio
        else:
            log_ratio = logp - logq
        loss, _ = get_policy_loss("grpo")(log_ratio=log_ratio, advantages=adv, mask=mask)
        loss.backward()
        values.append(loss.detach())
        grads.append(logits.grad.clone())
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-7)


def test_mask_invariance() -> None:
    """Scrambling every input at masked positions changes no output."""
    logits, y, logq, topk_ids, topk_logq, mask = _grad_setup(seed=5)
    logp, topk_logp = token_and_topk_logprobs(logits.detach(), y, topk_ids)
    args = dict(logp=logp, logq=logq, topk_logp=topk_logp, topk_logq=topk_logq, in_topk=token_in_topk(y, topk_ids))
    base = sis_log_ratio(**args, mask=mask, generator=torch.Generator().manual_seed(3))
    off = mask == 0
    scrambled = {}
    for name, x in args.items():
        x = x.clone()
        noise = torch.randn(x.shape) * 50 if x.dtype.is_floating_point else torch.ones(x.shape, dtype=x.dtype)
        x[off] = noise[off]
        scrambled[name] = x
    other = sis_log_ratio(**scrambled, mask=mask, generator=torch.Generator().manual_seed(3))
    assert torch.equal(base.accepted, other.accepted)
    assert torch.equal(base.log_ratio, other.log_ratio)
    for key in base.metrics:
        torch.testing.assert_close(base.metrics[key], other.metrics[key], rtol=0, atol=0, msg=key)


def test_same_seed_same_decisions() -> None:
    logits, y, logq, topk_ids, topk_logq, mask = _grad_setup(seed=9)
    logp, topk_logp = token_and_topk_logprobs(logits.detach(), y, topk_ids)
    kw = dict(logp=logp, logq=logq, topk_logp=topk_logp, topk_logq=topk_logq,
              in_topk=token_in_topk(y, topk_ids), mask=mask)
    a = sis_log_ratio(**kw, generator=torch.Generator().manual_seed(11)).accepted
    b = sis_log_ratio(**kw, generator=torch.Generator().manual_seed(11)).accepted
    assert torch.equal(a, b)


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("topk", [False, True])
def test_gather_matches_log_softmax(chunk_size: int | None, temperature: float, topk: bool) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 10, 97) * 4
    ids = torch.randint(0, 97, (3, 10, 6) if topk else (3, 10))
    ref_ids = ids if topk else ids.unsqueeze(-1)
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, ref_ids)
    ref = ref if topk else ref.squeeze(-1)
    got = gather_logprobs(logits, ids, temperature=temperature, chunk_size=chunk_size)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_gather_bf16_logits_are_upcast() -> None:
    logits = (torch.randn(2, 5, 300) * 3).to(torch.bfloat16)
    ids = torch.randint(0, 300, (2, 5))
    got = gather_logprobs(logits, ids, chunk_size=2)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_bad_arguments_name_themselves() -> None:
    logits = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs(logits, torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="k must be in"):
        behaviour_topk(logits, torch.zeros(1, 2, dtype=torch.long), k=6)


@pytest.mark.parametrize("pad", [-9999.0, float("-inf"), float("inf")])
def test_padded_topk_entries_are_outside_vk(pad: float) -> None:
    """A top-p nucleus smaller than K: engines pad q's top-K with a floor; padding must not enter M_t or xi_K."""
    logp_full = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    logq_full = torch.log(torch.tensor([0.6, 0.4, 0.0]))  # token 2 is outside q's nucleus
    topk_ids = torch.tensor([[[0, 1, 2]]])
    topk_logq = torch.tensor([[[logq_full[0], logq_full[1], pad]]])
    y = torch.tensor([[1]])
    res = sis_log_ratio(
        logp=logp_full[y], logq=logq_full[y], topk_logp=logp_full[topk_ids], topk_logq=topk_logq,
        in_topk=token_in_topk(y, topk_ids), mask=torch.ones(1, 1), generator=torch.Generator().manual_seed(0),
    )
    # M = max(0.5/0.6, 0.3/0.4) = 0.8333; xi = 1 - 0.5 - 0.3 = 0.2.
    assert math.isclose(res.log_m.item(), math.log(0.5 / 0.6), rel_tol=1e-5)
    assert math.isclose(res.metrics["sis/xi_k"].item(), 0.2, rel_tol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_gradient_matches_log_softmax(chunk_size: int | None, temperature: float, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = (torch.randn(3, 10, 97) * 4).to(dtype)
    ids = torch.randint(0, 97, (3, 10, 6))  # repeated ids within a position: their gradients add up
    weights = torch.randn(3, 10, 6)
    got_logits, ref_logits = base.clone().requires_grad_(), base.clone().requires_grad_()
    (gather_logprobs(got_logits, ids, temperature, chunk_size) * weights).sum().backward()
    (torch.log_softmax(ref_logits.float() / temperature, -1).gather(-1, ids) * weights).sum().backward()
    assert got_logits.grad is not None and ref_logits.grad is not None and got_logits.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_logits.grad.float(), ref_logits.grad.float(), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_keeps_no_float32_copy_of_the_logits_for_backward(dtype: torch.dtype) -> None:
    """By construction: every tensor autograd saves for the backward is recorded (saved_tensors_hooks); the only one
    of vocabulary width is the logits themselves (same storage), whatever the dtype or temperature."""
    logits = (torch.randn(2, 8, 300) * 3).to(dtype).requires_grad_()
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logp = gather_logprobs(logits, torch.randint(0, 300, (2, 8, 3)), temperature=0.7, chunk_size=2)
    wide = [t for t in saved if t.shape[-1] == 300]
    assert len(wide) == 1 and wide[0].untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    logp.sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
