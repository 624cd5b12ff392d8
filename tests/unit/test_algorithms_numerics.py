"""float32 numerics of the algorithms (issue 16 items 11 and 12).

Item 11: a token with log-ratio +-100 (exp overflows float32 past ~88.7) must give a finite loss and
finite gradients in every policy loss, equal to a float64 NumPy evaluation of the paper's formula
wherever that is finite in float32. Item 12: global / group / running statistics of rewards 1 +- 3e-4
in float32 must give whitened values with std 1, not the one-pass variance's garbage.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamrft.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossInputs,
    RunningMeanStd,
    aggregate_loss,
    whiten_advantages,
)
from streamrft.algorithms._masked import masked_global_mean_std
from streamrft.algorithms.ratios import LOG_RATIO_CAP
from streamrft.config.algorithm import AlgorithmConfig
from tests.unit.fake_ranks import run_ranks

F32_MAX = float(np.finfo(np.float32).max)

# Rows: (length, advantage, {position: log-ratio}). Extreme +100 tokens sit where the paper's loss is
# either clipped (A > 0) or overflows float32 anyway (A < 0 and a sequence mean past ~88); -100 anywhere.
ROWS = [
    (4, 0.8, {1: 100.0}),
    (3, -1.3, {0: -100.0}),
    (1, -0.7, {0: 100.0}),
    (4, 1.1, {2: -100.0}),
    (2, -0.4, {0: -100.0, 1: 100.0}),
    (5, 0.6, {}),
    (5, -0.9, {}),
]
T = 5


def extreme_inputs(seed: int = 0):
    """float32 inputs with the extreme tokens of ROWS, moderate log-ratios elsewhere, ragged mask."""
    g = torch.Generator().manual_seed(seed)
    B = len(ROWS)
    mask = torch.zeros(B, T)
    old = -torch.rand(B, T, generator=g) * 3 - 0.1
    lr = torch.randn(B, T, generator=g) * 0.3
    adv = torch.zeros(B, T)
    for i, (n, a, extreme) in enumerate(ROWS):
        mask[i, :n] = 1.0
        adv[i, :] = a
        for t, v in extreme.items():
            lr[i, t] = v
    logp = (old + lr).requires_grad_(True)
    return PolicyLossInputs(logp=logp, old_logp=old, advantages=adv, mask=mask, behaviour_logp=None)


def _np(x):
    return x.detach().numpy().astype(np.float64)


def reference(name: str, inp: PolicyLossInputs, cfg: AlgorithmConfig):
    """Per-token loss and d(sum of per-token losses)/d logp_t of the paper's formula, float64 NumPy,
    from the same float32 inputs (no cap anywhere), and ``beyond``: tokens whose value depends on an
    exp of more than LOG_RATIO_CAP (the documented regime where the ratio is held at e^cap instead)."""
    lr = _np(inp.logp) - _np(inp.old_logp)
    a, m = _np(inp.advantages), _np(inp.mask)
    el, eh = cfg.clip_eps_low, cfg.clip_eps_high
    with np.errstate(over="ignore", invalid="ignore"):
        if name in ("ppo_clip", "clip_higher", "dual_clip", "gspo"):
            if name == "gspo":
                n = np.maximum(m.sum(1, keepdims=True), 1)
                rho = np.repeat(np.exp((lr * m).sum(1, keepdims=True) / n), T, axis=1)
            else:
                rho = np.exp(lr)
            pg1, pg2 = -a * rho, -a * np.clip(rho, 1 - el, 1 + eh)
            loss = np.maximum(pg1, pg2)
            grad = np.where(pg2 > pg1, 0.0, -a * rho)  # gspo-token: d s_it / d logp_t = s_i
            beyond = (np.log(rho) > LOG_RATIO_CAP) & ~(pg2 > pg1)
            if name == "dual_clip":
                bound = -cfg.dual_clip_c * a
                dual = (a < 0) & (bound < loss)
                loss = np.where(dual, bound, loss)
                grad = np.where(dual, 0.0, grad)
                beyond = beyond & ~dual
        elif name == "gmpo":
            n = np.maximum(m.sum(1), 1)
            a_i = (a * m).sum(1) / n
            sgn = np.sign(a_i)[:, None]
            clip = np.clip(lr, -cfg.gmpo_clip_eps, cfg.gmpo_clip_eps)
            live = sgn * lr <= sgn * clip  # the unclipped branch (ties have the same derivative)
            l = sgn * np.minimum(sgn * lr, sgn * clip)
            g_i = np.exp((l * m).sum(1) / n)
            loss = np.repeat((-a_i * g_i)[:, None], T, axis=1)
            # sum over the n_i copies of L_i: n_i * (-A_i g_i / n_i) per unclipped token
            grad = np.where(live, (-a_i * g_i)[:, None], 0.0)
            beyond = np.repeat(((l * m).sum(1) / n > LOG_RATIO_CAP)[:, None], T, axis=1)
        elif name == "cpg":
            lo, hi = math.log(1 - el), math.log(1 + eh)
            pg1, pg2 = -a * lr, -a * np.clip(lr, lo, hi)
            rho = np.exp(lr)
            loss = np.maximum(pg1, pg2) + cfg.cpg_drift_coef * (rho - 1 - lr)
            grad = np.where(pg2 > pg1, 0.0, -a) + cfg.cpg_drift_coef * (rho - 1)
            beyond = lr > LOG_RATIO_CAP
        else:
            raise KeyError(name)
    return loss * m, grad * m, beyond & (m > 0)


def _finite32(x):
    return np.isfinite(x) & (np.abs(x) < F32_MAX)


@pytest.mark.parametrize("name", ["ppo_clip", "clip_higher", "dual_clip", "gspo", "gmpo", "cpg"])
def test_issue16_item11_log_ratio_100_gives_finite_loss_and_grads_equal_to_float64(name):
    cfg = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28 if name == "clip_higher" else 0.2, tis_mode="off")
    inp = extreme_inputs()
    out = POLICY_LOSSES[name](inp, cfg)
    n_tok = float(inp.mask.sum())
    total = aggregate_loss(out.loss, inp.mask, "token-mean", n_tok, len(ROWS), T)
    (grad_total,) = torch.autograd.grad(total, inp.logp, retain_graph=True)
    assert torch.isfinite(total), total
    assert torch.isfinite(grad_total).all(), grad_total
    for metric in out.metrics.values():
        assert torch.isfinite(metric).all()
    (grad,) = torch.autograd.grad(out.loss.sum(), inp.logp)
    ref_loss, ref_grad, beyond = reference(name, inp, cfg)
    ok_loss, ok_grad = _finite32(ref_loss) & ~beyond, _finite32(ref_grad) & ~beyond
    # every row has at least one comparable token and the moderate rows are compared in full
    assert ok_loss[5].all() and ok_loss[6].all() and ok_grad[5].all() and ok_grad[6].all()
    np.testing.assert_allclose(_np(out.loss)[ok_loss], ref_loss[ok_loss], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_np(grad)[ok_grad], ref_grad[ok_grad], rtol=1e-6, atol=1e-6)
    # the extreme tokens in a clipped branch (the NaN case before) are compared above
    extreme = np.abs(_np(inp.logp) - _np(inp.old_logp)) > 99
    assert (ok_grad & extreme).sum() >= 2
    # past the cap the loss is finite and the token pushes nothing (cpg keeps its linear -A and -alpha terms)
    # dual-clip bounds every A < 0 token, so there every token is compared; elsewhere some are capped
    assert not beyond.any() if name == "dual_clip" else beyond.any()
    assert np.isfinite(_np(out.loss)[beyond]).all()
    if name != "cpg":
        assert (_np(grad)[beyond] == 0).all()


@pytest.mark.parametrize("name", ["ppo_clip", "clip_higher", "dual_clip", "gspo", "gmpo", "cpg"])
def test_issue16_item11_one_extreme_token_does_not_poison_a_shared_parameter(name):
    """Like a model, every log-prob depends on one shared parameter theta: logp = old + theta * lr.
    Its gradient is finite and is the sum of the calm rows' and the extreme rows' own gradients."""
    cfg = AlgorithmConfig(clip_eps_high=0.28 if name == "clip_higher" else 0.2, tis_mode="off")
    base = extreme_inputs(seed=3)
    lr = (base.logp - base.old_logp).detach()

    def theta_grad(rows):
        theta = torch.ones((), requires_grad=True)
        inp = PolicyLossInputs(logp=base.old_logp[rows] + theta * lr[rows], old_logp=base.old_logp[rows],
                               advantages=base.advantages[rows], mask=base.mask[rows])
        loss = aggregate_loss(POLICY_LOSSES[name](inp, cfg).loss, inp.mask, "token-mean", 30.0, len(ROWS), T)
        (g,) = torch.autograd.grad(loss, theta)
        return g

    full, calm, wild = theta_grad([0, 1, 2, 3, 4, 5, 6]), theta_grad([5, 6]), theta_grad([0, 1, 2, 3, 4])
    assert torch.isfinite(full) and torch.isfinite(wild)
    assert calm.abs() > 0
    assert full.item() == pytest.approx(calm.item() + wild.item(), rel=1e-5, abs=1e-6)


def test_issue16_item11_past_the_cap_the_ratio_is_held_and_counted_as_clipped():
    cfg = AlgorithmConfig(tis_mode="off")
    logp = torch.tensor([[30.0, 10.0]], requires_grad=True)
    inp = PolicyLossInputs(logp=logp, old_logp=torch.zeros(1, 2), advantages=torch.full((1, 2), -1.0),
                           mask=torch.ones(1, 2))
    out = POLICY_LOSSES["ppo_clip"](inp, cfg)
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    assert out.loss[0, 0].item() == pytest.approx(math.exp(LOG_RATIO_CAP), rel=1e-6)
    assert out.loss[0, 1].item() == pytest.approx(math.exp(10.0), rel=1e-6)  # below the cap: the formula
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() == pytest.approx(math.exp(10.0), rel=1e-6)
    assert out.metrics["clipped"].tolist() == [[1.0, 0.0]]


# --- item 12: float64 two-pass statistics ---------------------------------------------------------

def offset_rewards(n: int, seed: int = 0, offset: float = 1.0, spread: float = 3e-4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (offset + spread * signs * (1 + torch.rand(n, generator=g))).to(torch.float32)


def test_issue16_item12_masked_global_mean_std_is_exact_for_a_large_common_offset():
    lengths = [5, 2, 7, 1, 4]
    x = offset_rewards(len(lengths) * 7, seed=1).reshape(len(lengths), 7)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(7)] for n in lengths])
    x_out = x.clone()
    x_out[mask == 0] = 1e6  # padding must not leak into the statistics
    mean, std = masked_global_mean_std(x_out, mask, lambda s: s)
    vals = np.array([float(x[i, t]) for i in range(len(lengths)) for t in range(lengths[i])], dtype=np.float64)
    assert mean.dtype == torch.float64
    assert mean.item() == pytest.approx(vals.mean(), rel=1e-12)
    assert std.item() == pytest.approx(vals.std(ddof=1), rel=1e-9)


def test_issue16_item12_whitened_rewards_around_one_have_std_one_in_float32():
    lengths = [6, 3, 8, 1, 5, 8]
    x = offset_rewards(len(lengths) * 8, seed=2).reshape(len(lengths), 8)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(8)] for n in lengths])
    vals = x[mask > 0].double().numpy()
    s = vals.std(ddof=1)
    for eps in (1e-9, 1e-6):
        out = whiten_advantages(x, mask, eps=eps)
        assert out.dtype == torch.float32
        w = out[mask > 0].double().numpy()
        assert w.std(ddof=1) == pytest.approx(s / (s + eps), abs=1e-4)
        np.testing.assert_allclose(w, (vals - vals.mean()) / (s + eps), atol=1e-5)
    assert whiten_advantages(x, mask, eps=1e-9)[mask > 0].double().std().item() == pytest.approx(1.0, abs=1e-3)


def test_issue16_item12_reinforce_plus_plus_on_two_ranks_gives_std_one_for_rewards_one_pm_3e4():
    cfg = AlgorithmConfig(advantage_estimator="reinforce++", norm_eps=1e-9)
    fn = ADVANTAGE_ESTIMATORS["reinforce++"].fn

    def inputs(lengths, seed):
        mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(6)] for n in lengths])
        return AdvantageInputs(rewards=offset_rewards(len(lengths), seed), group_index=torch.arange(len(lengths)),
                               response_mask=mask)

    a, b = inputs([6, 2, 4, 5], 3), inputs([1, 6, 3], 4)
    out_a, out_b = run_ranks([lambda r: fn(a, cfg, r), lambda r: fn(b, cfg, r)])
    adv = torch.cat([out_a.advantages[a.response_mask > 0], out_b.advantages[b.response_mask > 0]]).double()
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert adv.std().item() == pytest.approx(1.0, abs=1e-3)
    # against the plain float64 formula: every token of sample i carries its reward (gamma = 1)
    vals = np.concatenate([np.repeat(x.rewards.double().numpy(), x.response_mask.sum(1).long().numpy()) for x in (a, b)])
    ref = (vals - vals.mean()) / (vals.std(ddof=1) + 1e-9)
    np.testing.assert_allclose(adv.numpy(), ref, atol=1e-5)


def test_issue16_item12_group_norm_of_rewards_one_pm_3e4_has_unit_std_per_group():
    rewards = offset_rewards(16, seed=5)
    group = torch.tensor([0, 1] * 8)
    inp = AdvantageInputs(rewards=rewards, group_index=group, response_mask=torch.ones(16, 3))
    adv = ADVANTAGE_ESTIMATORS["group_norm"].fn(inp, AlgorithmConfig(norm_eps=1e-9)).advantages
    assert adv.dtype == torch.float32
    for gid in (0, 1):
        r = rewards[group == gid].double().numpy()
        a = adv[group == gid, 0].double().numpy()
        np.testing.assert_allclose(a, (r - r.mean()) / (r.std(ddof=1) + 1e-9), atol=1e-5)
        assert a.std(ddof=1) == pytest.approx(1.0, abs=1e-3)


def test_issue16_item12_running_mean_std_two_pass_survives_a_huge_offset():
    g = torch.Generator().manual_seed(6)
    steps = [(1e6 + 1e-3 * torch.randn(7, generator=g, dtype=torch.float64),
              1e6 + 1e-3 * torch.randn(4, generator=g, dtype=torch.float64)) for _ in range(3)]
    ranks = [RunningMeanStd(eps=1e-12), RunningMeanStd(eps=1e-12)]
    for a, b in steps:
        run_ranks([lambda r: ranks[0].update(a, r), lambda r: ranks[1].update(b, r)])
    seen = torch.cat([torch.cat(step) for step in steps]).numpy()
    for r in ranks:
        assert r.mean.item() == pytest.approx(seen.mean(), rel=1e-15, abs=1e-9)
        assert r.var.item() == pytest.approx(seen.var(), rel=1e-6)
    normalised = ranks[0].normalize(torch.tensor(seen)).numpy()
    assert normalised.std() == pytest.approx(1.0, abs=1e-3)


def test_issue16_item12_reported_reward_std_is_two_pass_across_ranks():
    from types import SimpleNamespace

    from streamrft.runtime.driver import _reward_stats

    def sample(r):
        return SimpleNamespace(header=SimpleNamespace(reward=r, reward_components={"correct": r - 1e8}))

    g = np.random.default_rng(7)
    a, b = 1e8 + 1e-4 * g.standard_normal(6), 1e8 + 1e-4 * g.standard_normal(3) + 5e-5
    out_a, out_b = run_ranks([lambda r: _reward_stats([sample(x) for x in a], r, ["correct"]),
                              lambda r: _reward_stats([sample(x) for x in b], r, ["correct"])])
    seen = np.concatenate([a, b])
    assert out_a == out_b
    assert out_a["reward_std"] == pytest.approx(seen.std(), rel=1e-6)  # one-pass: 0 or garbage at this offset
    assert out_a["reward_std/correct"] == pytest.approx((seen - 1e8).std(), rel=1e-6)
    assert out_a["reward_mean"] == pytest.approx(seen.mean(), rel=1e-15)
