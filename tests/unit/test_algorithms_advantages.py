"""Advantage estimators against plain-Python float64 formulas, on ragged, masked, interleaved batches."""

from __future__ import annotations

import math

import pytest
import torch

from streamrft.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, value_loss
from streamrft.config.algorithm import AlgorithmConfig
from tests.unit.fake_ranks import run_ranks

B, T = 9, 7
GROUPS = [2, 0, 1, 2, 0, 1, 2, 0, 1]  # interleaved: three groups of three, never contiguous


def make_inputs(seed: int = 0, token_rewards: bool = False, values: bool = False) -> AdvantageInputs:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        start = int(torch.randint(0, 2, (1,), generator=g))  # some rows start after a prompt token
        length = int(torch.randint(1, T - start + 1, (1,), generator=g))
        mask[i, start : start + length] = 1.0
    return AdvantageInputs(
        rewards=torch.rand(B, generator=g, dtype=torch.float64) * 2 - 1,
        group_index=torch.tensor(GROUPS, dtype=torch.int64),
        response_mask=mask,
        token_rewards=torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1 if token_rewards else None,
        values=torch.randn(B, T, generator=g, dtype=torch.float64) if values else None,
    )


def ref_group(r, gi, i):
    members = [r[j] for j in range(len(r)) if gi[j] == gi[i]]
    mean = sum(members) / len(members)
    std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1)) if len(members) > 1 else 0.0
    return members, mean, std


def ref_token_rewards(inp, i):
    m = inp.response_mask[i].tolist()
    last = max(t for t in range(T) if m[t] > 0)
    r = [0.0] * T
    for t in range(T):
        if m[t] > 0 and inp.token_rewards is not None:
            r[t] += float(inp.token_rewards[i, t])
    r[last] += float(inp.rewards[i])
    return r


def ref_returns(inp, i, gamma):
    r = ref_token_rewards(inp, i)
    return [sum(gamma ** (k - t) * r[k] for k in range(t, T)) for t in range(T)]


def spread(inp, per_seq):
    m = inp.response_mask.tolist()
    return torch.tensor([[per_seq[i] * m[i][t] for t in range(T)] for i in range(B)], dtype=torch.float64)


def test_group_norm_matches_unbiased_std_formula_with_interleaved_groups():
    inp, cfg = make_inputs(1), AlgorithmConfig(norm_eps=1e-6)
    r, gi = inp.rewards.tolist(), GROUPS
    expected = []
    for i in range(B):
        _, mean, std = ref_group(r, gi, i)
        expected.append((r[i] - mean) / (std + 1e-6))
    out = ADVANTAGE_ESTIMATORS["group_norm"].fn(inp, cfg)
    torch.testing.assert_close(out.advantages, spread(inp, expected), atol=1e-6, rtol=0)
    assert out.advantages.abs().sum() > 0.5, "rewards vary inside groups, so advantages must not all be zero"


def test_dr_grpo_and_cpgd_and_rloo_match_their_formulas():
    inp, cfg = make_inputs(2), AlgorithmConfig()
    r = inp.rewards.tolist()
    dr, loo, gn = [], [], []
    for i in range(B):
        members, mean, std = ref_group(r, GROUPS, i)
        dr.append(r[i] - mean)
        others = [r[j] for j in range(B) if GROUPS[j] == GROUPS[i] and j != i]
        loo.append(r[i] - sum(others) / len(others))
        gn.append((r[i] - mean) / (std + cfg.norm_eps))
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS["dr_grpo"].fn(inp, cfg).advantages, spread(inp, dr), atol=1e-6, rtol=0)
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS["rloo"].fn(inp, cfg).advantages, spread(inp, loo), atol=1e-6, rtol=0)
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS["cpgd"].fn(inp, cfg).advantages, spread(inp, gn), atol=1e-6, rtol=0)


def test_a_singleton_group_gets_zero_advantage_not_nan():
    inp = make_inputs(3)
    inp.group_index = torch.arange(B)
    for name in ("group_norm", "dr_grpo", "rloo", "cpgd"):
        adv = ADVANTAGE_ESTIMATORS[name].fn(inp, AlgorithmConfig()).advantages
        assert torch.equal(adv, torch.zeros_like(adv)), name


def test_reinforce_baseline_is_discounted_return_minus_group_mean_reward():
    inp, cfg = make_inputs(4, token_rewards=True), AlgorithmConfig(gamma=0.9)
    r = inp.rewards.tolist()
    m = inp.response_mask.tolist()
    expected = [
        [(ref_returns(inp, i, 0.9)[t] - ref_group(r, GROUPS, i)[1]) * m[i][t] for t in range(T)] for i in range(B)
    ]
    out = ADVANTAGE_ESTIMATORS["reinforce_baseline"].fn(inp, cfg)
    torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


def test_reinforce_gives_discounted_returns_and_gamma_is_not_silently_reset():
    inp = make_inputs(5, token_rewards=True)
    m = inp.response_mask.tolist()
    results = {}
    for gamma in (1.0, 0.5):
        out = ADVANTAGE_ESTIMATORS["reinforce"].fn(inp, AlgorithmConfig(gamma=gamma))
        expected = [[ref_returns(inp, i, gamma)[t] * m[i][t] for t in range(T)] for i in range(B)]
        torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)
        results[gamma] = out.advantages
    assert not torch.allclose(results[1.0], results[0.5])


def ref_gae(inp, i, gamma, lam):
    m = inp.response_mask[i].tolist()
    r = ref_token_rewards(inp, i)
    v = [float(inp.values[i, t]) * m[t] for t in range(T)]
    adv, nxt_a = [0.0] * T, 0.0
    for t in reversed(range(T)):
        v_next = v[t + 1] if t + 1 < T else 0.0
        nxt_a = r[t] + gamma * v_next - v[t] + gamma * lam * nxt_a
        adv[t] = nxt_a
    return [adv[t] * m[t] for t in range(T)], [(adv[t] + v[t]) * m[t] for t in range(T)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.8, 0.5)])
def test_gae_matches_the_backward_recursion_for_each_gamma_and_lambda(gamma, lam):
    inp = make_inputs(6, token_rewards=True, values=True)
    out = ADVANTAGE_ESTIMATORS["gae"].fn(inp, AlgorithmConfig(gamma=gamma, lam=lam))
    adv = [ref_gae(inp, i, gamma, lam)[0] for i in range(B)]
    ret = [ref_gae(inp, i, gamma, lam)[1] for i in range(B)]
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.returns, torch.tensor(ret, dtype=torch.float64), atol=1e-6, rtol=0)


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value():
    inp = make_inputs(7, values=True)
    out = ADVANTAGE_ESTIMATORS["gae"].fn(inp, AlgorithmConfig(gamma=1.0, lam=1.0))
    v = inp.values * inp.response_mask
    torch.testing.assert_close(out.advantages, inp.rewards[:, None] * inp.response_mask - v, atol=1e-6, rtol=0)


def test_gae_without_critic_values_raises_naming_the_estimator():
    with pytest.raises(ValueError, match=r"advantage_estimator=gae needs critic values \(AdvantageInputs.values is None\)"):
        ADVANTAGE_ESTIMATORS["gae"].fn(make_inputs(0), AlgorithmConfig())


def ref_reinforce_pp(inps, gamma, eps):
    rets = [[ref_returns(inp, i, gamma) for i in range(B)] for inp in inps]
    vals = [rets[k][i][t] for k, inp in enumerate(inps) for i in range(B) for t in range(T) if inp.response_mask[i, t] > 0]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (len(vals) - 1))
    return [
        torch.tensor([[(rets[k][i][t] - mean) / (std + eps) * float(inp.response_mask[i, t]) for t in range(T)] for i in range(B)], dtype=torch.float64)
        for k, inp in enumerate(inps)
    ]


def test_reinforce_plus_plus_normalises_returns_over_the_batch():
    inp, cfg = make_inputs(8, token_rewards=True), AlgorithmConfig(gamma=0.95)
    out = ADVANTAGE_ESTIMATORS["reinforce++"].fn(inp, cfg)
    torch.testing.assert_close(out.advantages, ref_reinforce_pp([inp], 0.95, cfg.norm_eps)[0], atol=1e-6, rtol=0)


def two_rank_call(fn, a, b, cfg):
    """Run fn on two 'ranks' a and b (threads) whose all_reduce_sum really sums across both."""
    return run_ranks([lambda reduce: fn(a, cfg, reduce), lambda reduce: fn(b, cfg, reduce)])


def test_reinforce_plus_plus_on_two_ranks_uses_global_statistics_not_per_rank_ones():
    cfg = AlgorithmConfig(gamma=1.0)
    a, b = make_inputs(9, token_rewards=True), make_inputs(10, token_rewards=True)
    b.rewards = b.rewards + 3.0  # rank b sees much larger rewards
    fn = ADVANTAGE_ESTIMATORS["reinforce++"].fn
    out_a, out_b = two_rank_call(fn, a, b, cfg)
    ref_a, ref_b = ref_reinforce_pp([a, b], 1.0, cfg.norm_eps)
    torch.testing.assert_close(out_a.advantages, ref_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(out_b.advantages, ref_b, atol=1e-6, rtol=0)
    per_rank_a = fn(a, cfg).advantages
    assert (per_rank_a - out_a.advantages).abs().max() > 0.1


def test_batch_estimators_whiten_globally_when_asked():
    cfg = AlgorithmConfig(whiten_advantages=True, gamma=0.9, lam=0.9)
    a, b = make_inputs(11, values=True), make_inputs(12, values=True)
    fn = ADVANTAGE_ESTIMATORS["gae"].fn
    out_a, out_b = two_rank_call(fn, a, b, cfg)
    raw = [fn(x, AlgorithmConfig(gamma=0.9, lam=0.9)).advantages for x in (a, b)]
    vals = [float(raw[k][i, t]) for k, x in enumerate((a, b)) for i in range(B) for t in range(T) if x.response_mask[i, t] > 0]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    torch.testing.assert_close(out_a.advantages, (raw[0] - mean) / (std + cfg.norm_eps) * a.response_mask, atol=1e-6, rtol=0)
    torch.testing.assert_close(out_b.advantages, (raw[1] - mean) / (std + cfg.norm_eps) * b.response_mask, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_writes_exact_zeros_outside_the_response_mask(name):
    inp = make_inputs(13, token_rewards=True, values=True)
    adv = ADVANTAGE_ESTIMATORS[name].fn(inp, AlgorithmConfig()).advantages
    assert adv.shape == (B, T)
    assert torch.equal(adv[inp.response_mask == 0], torch.zeros(int((inp.response_mask == 0).sum()), dtype=adv.dtype))
    assert torch.isfinite(adv).all()


def test_advantage_clip_bounds_every_estimator_output():
    inp = make_inputs(14)
    inp.rewards = inp.rewards * 100
    adv = ADVANTAGE_ESTIMATORS["dr_grpo"].fn(inp, AlgorithmConfig(advantage_clip=0.5)).advantages
    assert adv.abs().max() == pytest.approx(0.5)
    unclipped = ADVANTAGE_ESTIMATORS["dr_grpo"].fn(inp, AlgorithmConfig()).advantages
    torch.testing.assert_close(adv, unclipped.clamp(-0.5, 0.5))


def test_estimator_scopes_and_critic_needs_are_declared():
    group = {n for n, e in ADVANTAGE_ESTIMATORS.items() if e.scope == "group"}
    assert group == {"group_norm", "dr_grpo", "rloo", "reinforce_baseline", "cpgd"}
    assert {n for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs_critic} == {"gae"}


def test_clipped_value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors():
    g = torch.Generator().manual_seed(15)
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    returns = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = make_inputs(15).response_mask
    loss, metrics = value_loss(values, old, returns, mask, clip_eps=0.2)
    expected, clipped = [], []
    for i in range(B):
        row, crow = [], []
        for t in range(T):
            v, o, r, m = (float(x[i, t]) for x in (values, old, returns, mask))
            unclipped = (v - r) ** 2
            vc = o + min(max(v - o, -0.2), 0.2)
            row.append(0.5 * max(unclipped, (vc - r) ** 2) * m)
            crow.append(float((vc - r) ** 2 > unclipped) * m)
        expected.append(row)
        clipped.append(crow)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0)
    assert metrics["vf_clipped"].tolist() == clipped and 0 < sum(map(sum, clipped))
    off, _ = value_loss(values, old, returns, mask, clip_eps=0.0)
    torch.testing.assert_close(off, 0.5 * (values - returns) ** 2 * mask)
