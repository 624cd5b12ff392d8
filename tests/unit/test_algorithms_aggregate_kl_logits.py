"""Loss aggregation over microbatches, KL estimators and controllers, log-probs and entropy from logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamrft.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    entropy_from_logits,
    entropy_from_logits_chunked,
    logprobs_from_logits,
    make_kl_controller,
)
from streamrft.config.algorithm import AlgorithmConfig

B, T, MAXLEN = 6, 5, 9
LENGTHS = [5, 0, 2, 4, 1, 3]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS], dtype=torch.float64)
    loss = torch.randn(B, T, generator=g, dtype=torch.float64).requires_grad_(True)
    return loss, mask


def ref_aggregate(loss, mask, mode):
    L, m = loss.detach().tolist(), mask.tolist()
    n_tok = sum(map(sum, m))
    sums = [sum(L[i][t] for t in range(T) if m[i][t]) for i in range(B)]
    if mode == "token-mean":
        return sum(sums) / n_tok
    if mode == "seq-mean-token-mean":
        return sum(s / sum(m[i]) if sum(m[i]) else 0.0 for i, s in enumerate(sums)) / B
    if mode == "seq-mean-token-sum":
        return sum(sums) / B
    return sum(s / MAXLEN for s in sums) / B


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_matches_its_formula(mode):
    loss, mask = batch(1)
    got = aggregate_loss(loss, mask, mode, float(mask.sum()), float(B), MAXLEN)
    assert got.item() == pytest.approx(ref_aggregate(loss, mask, mode), abs=1e-9)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_summing_microbatches_with_global_normalisers_equals_the_whole_batch(mode):
    loss, mask = batch(2)
    n_tok, n_seq = float(mask.sum()), float(B)
    whole = aggregate_loss(loss, mask, mode, n_tok, n_seq, MAXLEN)
    parts = sum(aggregate_loss(loss[s], mask[s], mode, n_tok, n_seq, MAXLEN) for s in (slice(0, 1), slice(1, 4), slice(4, 6)))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-12)
    (g_whole,) = torch.autograd.grad(whole, loss)
    (g_parts,) = torch.autograd.grad(parts, loss)
    torch.testing.assert_close(g_parts, g_whole)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_fully_masked_microbatch_gives_zero_loss_and_zero_gradient_not_nan(mode):
    loss = torch.full((2, T), float("nan"), dtype=torch.float64).requires_grad_(True)
    mask = torch.zeros(2, T, dtype=torch.float64)
    for n_tok, n_seq in ((0.0, 0.0), (10.0, 4.0)):
        out = aggregate_loss(loss, mask, mode, n_tok, n_seq, MAXLEN)
        assert out.item() == 0.0
        (g,) = torch.autograd.grad(out, loss)
        assert torch.equal(g, torch.zeros_like(g))


def test_unknown_aggregation_mode_names_the_valid_ones():
    loss, mask = batch()
    with pytest.raises(ValueError, match="algorithm.loss_agg_mode='mean': choose one of token-mean, seq-mean-token-mean, "
                       "seq-mean-token-sum, seq-mean-token-sum-norm"):
        aggregate_loss(loss, mask, "mean", 1, 1, 1)


def test_kl_estimators_match_schulmans_formulas():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 4
    lp, rf = logp.numpy(), ref.numpy()
    np.testing.assert_allclose(KL_ESTIMATORS["k1"](logp, ref).numpy(), lp - rf, atol=1e-12)
    np.testing.assert_allclose(KL_ESTIMATORS["k2"](logp, ref).numpy(), 0.5 * (lp - rf) ** 2, atol=1e-12)
    np.testing.assert_allclose(KL_ESTIMATORS["k3"](logp, ref).numpy(), np.exp(rf - lp) - (rf - lp) - 1, atol=1e-9)
    assert (KL_ESTIMATORS["k3"](logp, ref) >= 0).all()


def test_k3_is_an_unbiased_estimate_of_the_true_kl_on_a_small_vocabulary():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    # expectation of the estimator under p, computed exactly over the vocabulary
    for name in ("k1", "k3"):
        expected = float((p * KL_ESTIMATORS[name](p.log(), q.log())).sum())
        assert expected == pytest.approx(true_kl, abs=1e-12), name


def test_adaptive_kl_controller_follows_ziegler_update_with_clipped_error():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=1000, error_clip=0.2)
    ctl.update(current_kl=7.2, n_steps=100)  # error 0.2 exactly
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    before = ctl.value
    ctl.update(current_kl=60.0, n_steps=50)  # error 9 clipped to 0.2
    assert ctl.value == pytest.approx(before * (1 + 0.2 * 50 / 1000))
    before = ctl.value
    ctl.update(current_kl=3.0, n_steps=10)  # error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(before * (1 - 0.2 * 10 / 1000))
    fresh = AdaptiveKLController(0.0, 6.0, 1000, 0.2)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value


def test_fixed_kl_controller_never_moves_and_the_factory_reads_the_config():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05
    assert isinstance(make_kl_controller(AlgorithmConfig(kl_coef=0.05)), FixedKLController)
    adaptive = make_kl_controller(AlgorithmConfig(kl_coef=0.05, kl_ctl_type="adaptive", kl_target=2.0, kl_horizon=10))
    assert isinstance(adaptive, AdaptiveKLController) and (adaptive.target, adaptive.horizon) == (2.0, 10)


def test_logprobs_apply_the_temperature_before_the_softmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 7, (2, 3), generator=g)
    z, y = logits.numpy(), targets.numpy()
    for temp in (1.0, 0.6):
        got = logprobs_from_logits(logits, targets, temperature=temp).numpy()
        for b in range(2):
            for t in range(3):
                row = z[b, t] / temp
                expected = row[y[b, t]] - math.log(sum(math.exp(v) for v in row))
                assert got[b, t] == pytest.approx(expected, abs=1e-9)
    assert not torch.allclose(logprobs_from_logits(logits, targets, 0.6), logprobs_from_logits(logits, targets, 1.0))
    with pytest.raises(ValueError, match=r"temperature=0 must be > 0 \(engine.temperature\)"):
        logprobs_from_logits(logits, targets, 0)


def test_entropy_matches_minus_sum_p_log_p_and_stays_finite_for_huge_logits():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 11, generator=g, dtype=torch.float64) * 2
    p = torch.softmax(logits, -1).numpy()
    np.testing.assert_allclose(entropy_from_logits(logits).numpy(), -(p * np.log(p)).sum(-1), atol=1e-9)
    p2 = torch.softmax(logits / 0.5, -1).numpy()
    np.testing.assert_allclose(entropy_from_logits(logits, 0.5).numpy(), -(p2 * np.log(p2)).sum(-1), atol=1e-9)
    huge = torch.tensor([[[1e4, 0.0, -1e4], [5e3, 5e3, -1e4]]], dtype=torch.float32)
    h = entropy_from_logits(huge)
    assert torch.isfinite(h).all()
    torch.testing.assert_close(h, torch.tensor([[0.0, math.log(2)]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy_from_logits_chunked(logits, chunk_rows=3), entropy_from_logits(logits))


def test_half_precision_logits_are_scored_in_float32():
    logits = torch.randn(1, 2, 5).to(torch.bfloat16)
    assert logprobs_from_logits(logits, torch.zeros(1, 2, dtype=torch.long)).dtype == torch.float32
    assert entropy_from_logits(logits).dtype == torch.float32
