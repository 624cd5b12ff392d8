"""Filters and shaping: DAPO dynamic sampling and overlong handling, forking tokens, reward normalisation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamrft.algorithms import (
    RunningMeanStd,
    clip_advantages,
    clip_rewards,
    high_entropy_token_mask,
    overlong_filter,
    overlong_penalty,
    whiten_advantages,
    zero_variance_groups,
)
from tests.unit.fake_ranks import run_ranks


def test_zero_variance_groups_flags_every_sample_of_an_all_equal_group_even_when_interleaved():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.5, 0.0])
    groups = torch.tensor([7, 3, 7, 9, 3, 7, 9, 3])
    # group 7: all 1.0 -> flagged; group 3: all 0.0 -> flagged; group 9: all 0.5 -> flagged
    assert zero_variance_groups(rewards, groups).tolist() == [True] * 8
    rewards[6] = 0.4
    assert zero_variance_groups(rewards, groups).tolist() == [True, True, True, False, True, True, False, True]


def test_overlong_penalty_is_zero_then_linear_then_minus_factor():
    lengths = torch.tensor([0, 12, 13, 16, 20, 21, 50])
    got = overlong_penalty(lengths, max_len=20, buffer_len=8, penalty_factor=0.5).tolist()

    def ref(L):
        if L <= 12:
            return 0.0
        if L <= 20:
            return (12 - L) / 8 * 0.5
        return -0.5

    assert got == pytest.approx([ref(int(L)) for L in lengths], abs=1e-12)
    assert overlong_penalty(lengths, 20, 0, 0.5).tolist() == [0.0] * 7


def test_overlong_filter_zeroes_the_mask_of_truncated_samples_only():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = overlong_filter(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_high_entropy_mask_keeps_the_top_fraction_of_masked_tokens_over_the_batch():
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0] * 6, [1.0] * 3 + [0.0] * 3, [1.0] * 5 + [0.0], [0.0] * 6], dtype=torch.float64)
    entropy[0, 5] = 99.0  # a padded-position-free maximum; and a huge value under the mask = 0 below
    entropy[1, 4] = 1e9
    out = high_entropy_token_mask(entropy, mask, top_fraction=0.2)
    vals = sorted((float(entropy[i, t]) for i in range(4) for t in range(6) if mask[i, t] > 0), reverse=True)
    k = math.ceil(0.2 * len(vals))
    expected = [[1.0 if mask[i, t] > 0 and float(entropy[i, t]) >= vals[k - 1] else 0.0 for t in range(6)] for i in range(4)]
    assert out.tolist() == expected and out.sum() == k
    assert out[1, 4] == 0.0, "a token outside the response mask is never kept"
    assert torch.equal(high_entropy_token_mask(entropy, mask, 1.0), mask)


def test_running_mean_std_equals_the_statistics_of_everything_seen_across_two_ranks():
    g = torch.Generator().manual_seed(1)
    steps = [(torch.randn(5, generator=g) * 3 + 1, torch.randn(3, generator=g) + 4) for _ in range(3)]
    ranks = [RunningMeanStd(eps=1e-6), RunningMeanStd(eps=1e-6)]
    for a, b in steps:
        run_ranks([lambda reduce: ranks[0].update(a, reduce), lambda reduce: ranks[1].update(b, reduce)])
    seen = np.concatenate([np.concatenate([a.numpy(), b.numpy()]) for a, b in steps]).astype(np.float64)
    for r in ranks:
        assert r.count.item() == len(seen)
        assert r.mean.item() == pytest.approx(seen.mean(), abs=1e-6)
        assert r.var.item() == pytest.approx(seen.var(), abs=1e-6)
    x = torch.tensor([0.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(ranks[0].normalize(x), (x - seen.mean()) / (math.sqrt(seen.var()) + 1e-6))
    restored = RunningMeanStd()
    restored.load_state_dict(ranks[0].state_dict())
    torch.testing.assert_close(restored.normalize(x), ranks[0].normalize(x))


def test_whitening_is_global_across_ranks_and_differs_from_per_rank_whitening():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(2, 4, generator=g, dtype=torch.float64) + 5
    ma = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    mb = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    wa, _ = run_ranks([lambda reduce: whiten_advantages(a, ma, reduce, eps=1e-6),
                       lambda reduce: whiten_advantages(b, mb, reduce, eps=1e-6)])
    vals = np.array([float(a[i, t]) for i in range(3) for t in range(4) if ma[i, t]] + [float(b[i, t]) for i in range(2) for t in range(4) if mb[i, t]])
    expected = (a.numpy() - vals.mean()) / (vals.std(ddof=1) + 1e-6) * ma.numpy()
    np.testing.assert_allclose(wa.numpy(), expected, atol=1e-9)
    per_rank = whiten_advantages(a, ma, eps=1e-6)
    assert (per_rank - wa).abs().max() > 0.5


def test_reward_and_advantage_clips_are_off_at_zero_and_symmetric_otherwise():
    x = torch.tensor([-3.0, -0.5, 0.2, 4.0])
    assert torch.equal(clip_rewards(x, 0.0), x) and torch.equal(clip_advantages(x, 0.0), x)
    assert clip_rewards(x, 1.0).tolist() == pytest.approx([-1.0, -0.5, 0.2, 1.0])
    assert clip_advantages(x, 0.3).tolist() == pytest.approx([-0.3, -0.3, 0.2, 0.3])
