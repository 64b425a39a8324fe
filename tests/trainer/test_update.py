"""The update step on a fixed batch: non-finite guard, dynamic sampling, recompute q, rollout shards."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from sisrl.trainer.batch import RolloutBatch, collate
from sisrl.trainer.config import TrainConfig
from sisrl.trainer.policy import build_optimizer, build_scheduler, load_policy
from sisrl.trainer.sampling import SyntheticSource
from sisrl.trainer.update import Updater, rank_shard, recompute_behaviour, train_on_batch

from tests.trainer.helpers import synthetic_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, RolloutBatch]:
    torch.set_num_threads(1)
    cfg = synthetic_config(tmp_path_factory.mktemp("u"), rollout={"prompts_per_step": 2, "samples_per_prompt": 4})
    model, tok = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    trajs = SyntheticSource(model, cfg.rollout, k=8, seed=0, vocab_size=len(tok)).rollouts([], 0, 0)
    return cfg, collate(trajs, pad_id=int(tok.pad_token_id), k=8)


def _updater(cfg: TrainConfig) -> Updater:
    model, _ = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    opt = build_optimizer(model, cfg.optim)
    return Updater(model=model, optimizer=opt, scheduler=build_scheduler(opt, cfg.optim, 10), algo=cfg.algorithm,
                   optim=cfg.optim, temperature=1.0)


def _params(u: Updater) -> list[torch.Tensor]:
    return [p.detach().clone() for p in u.model.parameters()]


def test_non_finite_loss_skips_every_step_and_keeps_weights(setup: tuple[TrainConfig, RolloutBatch]) -> None:
    cfg, b = setup
    u = _updater(cfg)
    before = _params(u)
    bad = b.with_behaviour(torch.full_like(b.logq, float("-inf")), b.topk_ids, b.topk_logq)  # ratio = inf
    bad = replace(bad, rewards=torch.arange(b.size, dtype=torch.float32))  # non-zero advantages
    out = train_on_batch(u, bad, torch.Generator().manual_seed(0))
    assert out["guard/skipped_updates"] == cfg.algorithm.staleness
    for p0, p1 in zip(before, _params(u), strict=True):
        assert torch.equal(p0, p1)
    assert u.scheduler.last_epoch == cfg.algorithm.staleness  # the schedule still advances


def test_dynamic_sampling_drops_groups_with_equal_rewards(setup: tuple[TrainConfig, RolloutBatch]) -> None:
    cfg, b = setup
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"dynamic_sampling": True,
                                                                               "staleness": 2})})
    flat = replace(b, rewards=torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]))  # group 0 all equal
    out = train_on_batch(_updater(cfg), flat, torch.Generator().manual_seed(0))
    assert out["rollout/kept_frac"] == 0.5
    assert out["guard/skipped_updates"] == 0.0


def test_recompute_q_accepts_every_top_k_token_on_the_first_update(tmp_path_factory: pytest.TempPathFactory) -> None:
    # N = 1 and q recomputed by the same weights: pi == q exactly, so w_t = M_t = 1 and every token in V_K is
    # accepted. Responses sampled near-greedily (temperature 0.05) are argmax tokens, hence in V_K: accept rate 1.
    torch.set_num_threads(1)
    cfg = synthetic_config(tmp_path_factory.mktemp("r"), rollout={"prompts_per_step": 2, "samples_per_prompt": 4,
                                                                  "temperature": 0.05},
                           algorithm={"behaviour": "recompute", "staleness": 1})
    model, tok = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    trajs = SyntheticSource(model, cfg.rollout, k=8, seed=0, vocab_size=len(tok)).rollouts([], 0, 0)
    b = collate(trajs, pad_id=int(tok.pad_token_id), k=8)
    u = replace(_updater(cfg), temperature=1.0)
    out = train_on_batch(u, replace(b, rewards=torch.arange(b.size, dtype=torch.float32)),
                         torch.Generator().manual_seed(0))
    assert out["sis/accept_rate"] == 1.0
    assert out["sis/D"] == 0.0 and out["sis/D_sis"] == 0.0


def test_exact_sis_accepts_every_token_at_the_first_update_and_fewer_after(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Exact SIS (K = V): the first mini-batch sees pi == q over the whole vocabulary, so every token (not only
    # those in a top-K) is accepted, xi is 0; later mini-batches of the same batch see the moved pi against the
    # kept copy of the sampling weights, so some tokens are rejected. Samples at temperature 1: many lie outside
    # any small top-K.
    torch.set_num_threads(1)
    cfg = synthetic_config(tmp_path_factory.mktemp("x"), rollout={"prompts_per_step": 2, "samples_per_prompt": 4},
                           algorithm={"behaviour": "recompute", "staleness": 4, "sis_exact": True, "logprobs_k": 2},
                           optim={"lr": 0.05})
    model, tok = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    trajs = SyntheticSource(model, cfg.rollout, k=2, seed=0, vocab_size=len(tok)).rollouts([], 0, 0)
    b = replace(collate(trajs, pad_id=int(tok.pad_token_id), k=2), rewards=torch.arange(8, dtype=torch.float32))
    u = _updater(cfg)
    first = train_on_batch(replace(u, algo=cfg.algorithm.model_copy(update={"staleness": 1})), b,
                           torch.Generator().manual_seed(0))
    assert first["sis/accept_rate"] == 1.0 and first["sis/xi_k"] == 0.0
    u = _updater(cfg)
    out = train_on_batch(u, b, torch.Generator().manual_seed(0))
    assert u.behaviour_model is not None and u.behaviour_model is not u.model
    assert 0.0 < out["sis/accept_rate"] < 1.0 and out["sis/xi_k"] == 0.0


def test_rank_shards_cover_the_mini_batch_once(setup: tuple[TrainConfig, RolloutBatch]) -> None:
    _, b = setup
    mb = b.select(torch.arange(7))
    adv = torch.arange(7, dtype=torch.float32)
    shards = [rank_shard(mb, adv, r, 2) for r in range(2)]
    assert [s.size for s, _ in shards] == [4, 4]  # 4 + 3 rows and one zero-mask pad row
    assert shards[1][0].mask[-1].sum() == 0
    real = torch.cat([a[: (4 if r == 0 else 3)] for r, (_, a) in enumerate(shards)])
    assert sorted(real.tolist()) == adv.tolist()
    assert sum(float(s.mask.sum()) for s, _ in shards) == float(mb.mask.sum())


@pytest.mark.parametrize("strategy", ["is", "sis"])
def test_ratio_metrics_describe_the_ratio_the_loss_used(tmp_path: Path, strategy: str) -> None:
    # Near-greedy samples (temperature 0.05) lie in q's top-K. With q recorded 3 nats below the sampling policy on
    # every token, at the first update the IS ratio is e^3 ~ 20.09 everywhere, while the SIS test accepts every
    # token (w_t / M_t = 1 when all of V_K shifts alike) and its ratio is 1. Each strategy logs its own.
    torch.set_num_threads(1)
    cfg = synthetic_config(tmp_path, rollout={"prompts_per_step": 2, "samples_per_prompt": 4, "temperature": 0.05},
                           algorithm={"ratio": strategy, "staleness": 1})
    model, tok = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    trajs = SyntheticSource(model, cfg.rollout, k=8, seed=0, vocab_size=len(tok)).rollouts([], 0, 0)
    b = collate(trajs, pad_id=int(tok.pad_token_id), k=8)
    shifted = b.with_behaviour(b.logq - 3.0, b.topk_ids, b.topk_logq - 3.0)
    out = train_on_batch(replace(_updater(cfg), temperature=0.05),  # pi at the sampling temperature
                         replace(shifted, rewards=torch.arange(b.size, dtype=torch.float32)),
                         torch.Generator().manual_seed(0))
    assert out["sis/accept_rate"] == 1.0  # the SIS test (the loss's, or the diagnostic beside IS)
    expected = 20.09 if strategy == "is" else 1.0
    assert out["sis/ratio_min"] == pytest.approx(expected, rel=1e-3)
    assert out["sis/ratio_max"] == pytest.approx(expected, rel=1e-3)


def _holey(b: RolloutBatch) -> RolloutBatch:
    """The batch with every third response position masked out, as inserted observation tokens are."""
    keep = torch.ones_like(b.mask)
    keep[:, 1::3] = 0
    return b.with_mask(b.mask * keep)


def test_compact_logits_match_the_full_forward_at_every_policy_token(setup: tuple[TrainConfig, RolloutBatch]) -> None:
    from sisrl.trainer.policy import policy_logits, response_logits
    from sisrl.trainer.sis import gather_logprobs

    cfg, b = setup
    b = _holey(b)
    model, _ = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    logits, view = policy_logits(model, b, compact=True)
    assert view.compacted and logits.shape[1] == int(b.mask.sum(dim=1).max()) < b.response_len
    full = gather_logprobs(response_logits(model, b), b.response_ids)[b.mask > 0]
    compact = gather_logprobs(logits, view.response_ids)[view.mask > 0]
    torch.testing.assert_close(compact, full, rtol=1e-5, atol=1e-5)  # the same tokens, in the same order
    with pytest.raises(ValueError, match="padded layout"):
        response_logits(model, view)


def test_an_update_on_compact_logits_moves_the_weights_as_the_full_layout_does(
        setup: tuple[TrainConfig, RolloutBatch]) -> None:
    cfg, b = setup
    b = _holey(b)
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"ratio": "is", "staleness": 1})})
    after = []
    for compact in (False, True):
        u = replace(_updater(cfg), compact_logits=compact)
        grads: list[list[torch.Tensor]] = []  # what each optimizer step is handed, clipping included
        u.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, seen=grads, model=u.model: seen.append(
                [p.grad.detach().clone() for p in model.parameters()]))
        metrics = train_on_batch(u, b, torch.Generator().manual_seed(0))
        after.append((grads, metrics))
    (g_full, m_full), (g_compact, m_compact) = after
    for key in ("actor/loss", "actor/entropy", "actor/grad_norm"):
        assert m_compact[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-6), key
    # Gradients, not the weights after AdamW: its first step moves a weight by ~lr * sign(grad), so an element whose
    # gradient is rounding noise (an embedding row no token used) moves either way by kernel choice (seen with torch
    # capped at AVX2: 0.1 % of the embedding off by up to 7.5e-6). The optimizer is the same code on both layouts.
    assert len(g_compact) == len(g_full) >= 1
    for step_full, step_compact in zip(g_full, g_compact, strict=True):
        for x, y in zip(step_full, step_compact, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5 * float(x.abs().max()) + 1e-12)


def test_trainable_layers_freeze_everything_below_the_top_layers(setup: tuple[TrainConfig, RolloutBatch]) -> None:
    cfg, b = setup
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"trainable_layers": 1})})
    u = _updater(cfg)
    names = [n for n, p in u.model.named_parameters() if p.requires_grad]
    assert names and all(n.startswith(("model.layers.1.", "model.norm.")) for n in names), names
    before = dict((n, p.detach().clone()) for n, p in u.model.named_parameters())
    train_on_batch(u, b, torch.Generator().manual_seed(0))
    for n, p in u.model.named_parameters():
        moved = not torch.equal(p.detach(), before[n])
        assert moved == (n in names), n


def test_trainable_layers_beyond_the_model_is_an_error_naming_both_counts(setup: tuple[TrainConfig, RolloutBatch]) -> None:
    cfg, _ = setup
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"trainable_layers": 3})})
    with pytest.raises(ValueError, match=r"trainable_layers=3: the model has only 2 decoder layers"):
        load_policy(cfg.model, seed=0, device=torch.device("cpu"))


def test_recompute_q_runs_the_head_at_the_policy_tokens_only(setup: tuple[TrainConfig, RolloutBatch]) -> None:
    """`recompute` q through the update's compact forward: at every policy token the same log-probs and top-K
    as the full [b, T, V] forward, zeros at inserted tokens, and the head never sees more than T' columns."""
    cfg, b = setup
    model, _ = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    mask = b.mask.clone()
    mask[:, 1::3] = 0.0  # every third token inserted by the environment
    mask[0, :] = 0.0  # and a row with no policy token at all
    b = b.with_mask(mask)
    seen: list[tuple[int, ...]] = []
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: seen.append(tuple(out.shape)))
    try:
        compact = recompute_behaviour(model, b, k=5, temperature=1.0, chunk_size=None, autocast=False, micro=3)
    finally:
        handle.remove()
    full = recompute_behaviour(model, b, k=5, temperature=1.0, chunk_size=None, autocast=False, micro=3,
                               compact=False)
    keep = mask > 0
    t_policy = int(keep.sum(dim=1).max())
    assert t_policy < b.response_len and all(shape[1] <= t_policy for shape in seen), seen
    torch.testing.assert_close(compact.logq[keep], full.logq[keep], rtol=0, atol=1e-5)
    torch.testing.assert_close(compact.topk_logq[keep], full.topk_logq[keep], rtol=0, atol=1e-5)
    assert torch.equal(compact.topk_ids[keep], full.topk_ids[keep])
    assert not compact.logq[~keep].any() and not compact.topk_ids[~keep].any() and not compact.topk_logq[~keep].any()
