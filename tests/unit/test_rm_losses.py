"""RM pair losses against independent NumPy formulas (to 1e-6), ties, margins, temperature, heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrft.rm.losses import PAIR_LOSSES, bradley_terry, hps, log_exp, pairwise_accuracy

RNG = np.random.default_rng(0)
R_C = RNG.normal(size=7) * 3
R_R = RNG.normal(size=7) * 3
MARGIN = np.abs(RNG.normal(size=7))
TIE = np.array([False, True, False, False, True, False, False])


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_bradley_terry_is_minus_log_sigmoid_of_the_difference_minus_the_margin():
    got = bradley_terry(t(R_C), t(R_R), margin=t(MARGIN)).numpy()
    assert np.allclose(got, -np.log(np_sigmoid(R_C - R_R - MARGIN)), atol=1e-6)
    got0 = bradley_terry(t(R_C), t(R_R)).numpy()
    assert np.allclose(got0, -np.log(np_sigmoid(R_C - R_R)), atol=1e-6)


def test_log_exp_is_log_one_plus_exp_of_rejected_minus_chosen():
    got = log_exp(t(R_C), t(R_R)).numpy()
    assert np.allclose(got, np.log1p(np.exp(R_R - R_C)), atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_hps_is_cross_entropy_over_the_pair_with_the_chosen_as_target(temperature):
    got = hps(t(R_C), t(R_R), temperature=temperature).numpy()
    zc, zr = R_C / temperature, R_R / temperature
    expected = -(zc - np.log(np.exp(zc) + np.exp(zr)))
    assert np.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("name", sorted(PAIR_LOSSES))
def test_a_tie_pair_gets_the_symmetric_half_target_loss_and_ignores_its_margin(name):
    got = PAIR_LOSSES[name](t(R_C), t(R_R), margin=t(MARGIN), tie=torch.tensor(TIE)).numpy()
    d = R_C - R_R
    tie_loss = 0.5 * (np.log1p(np.exp(-d)) + np.log1p(np.exp(d)))
    assert np.allclose(got[TIE], tie_loss[TIE], atol=1e-6)
    swapped = PAIR_LOSSES[name](t(R_R), t(R_C), tie=torch.tensor(TIE)).numpy()
    assert np.allclose(got[TIE], swapped[TIE], atol=1e-9)  # symmetric in the two responses
    strict = PAIR_LOSSES[name](t(R_C), t(R_R), margin=t(MARGIN)).numpy()
    assert np.allclose(got[~TIE], strict[~TIE], atol=1e-12)


def test_a_tie_loss_is_smallest_when_the_two_rewards_are_equal():
    d = torch.linspace(-3, 3, 61, dtype=torch.float64)
    loss = bradley_terry(d, torch.zeros_like(d), tie=torch.ones(61, dtype=torch.bool))
    assert d[loss.argmin()].item() == pytest.approx(0.0)
    assert loss.min().item() == pytest.approx(np.log(2.0), abs=1e-9)


def test_per_pair_margins_and_ties_broadcast_over_reward_heads():
    r_c = t(np.stack([R_C, R_C + 1], axis=1))
    r_r = t(np.stack([R_R, R_R], axis=1))
    got = bradley_terry(r_c, r_r, margin=t(MARGIN), tie=torch.tensor(TIE)).numpy()
    assert got.shape == (7, 2)
    assert np.allclose(got[~TIE, 1], -np.log(np_sigmoid(R_C + 1 - R_R - MARGIN))[~TIE], atol=1e-6)


def test_pairwise_accuracy_counts_equal_rewards_as_wrong():
    assert pairwise_accuracy(t([1.0, 2.0, 0.0, 3.0]), t([0.0, 2.0, 1.0, 2.0])) == 0.5


def test_hps_rejects_a_non_positive_temperature():
    with pytest.raises(ValueError, match="temperature=0 must be > 0"):
        hps(t(R_C), t(R_R), temperature=0)
