"""Policy losses against NumPy float64 formulas; sequence losses' gradients against the paper objectives."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamrft.algorithms import POLICY_LOSSES, PolicyLossInputs, aggregate_loss
from streamrft.config.algorithm import AlgorithmConfig

B, T = 6, 8


def make_inputs(seed=0, behaviour=True, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    lengths = [8, 3, 5, 1, 7, 4]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    beh = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8 if behaviour else None
    return PolicyLossInputs(logp=logp, old_logp=old, advantages=adv, mask=mask, behaviour_logp=beh)


def np_(x):
    return x.detach().numpy().astype(np.float64)


def ref_tis(inp, cfg):
    m = np_(inp.mask)
    if inp.behaviour_logp is None or cfg.tis_mode == "off":
        return np.ones_like(m), np.zeros_like(m)
    logw = (np_(inp.old_logp) - np_(inp.behaviour_logp)) * m
    if cfg.tis_mode == "sequence":
        logw = np.repeat(logw.sum(1, keepdims=True), T, axis=1)
    w = np.exp(logw)
    return np.minimum(w, cfg.tis_cap), (w > cfg.tis_cap).astype(np.float64)


def ref_ppo(inp, cfg):
    rho = np.exp(np_(inp.logp) - np_(inp.old_logp))
    a = np_(inp.advantages)
    pg1, pg2 = -a * rho, -a * np.clip(rho, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    return np.maximum(pg1, pg2), (pg2 > pg1).astype(np.float64), rho


@pytest.mark.parametrize("tis_mode", ["token", "sequence", "off"])
def test_ppo_clip_matches_formula_times_truncated_is_weight(tis_mode):
    cfg = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28, tis_mode=tis_mode, tis_cap=1.5)
    inp = make_inputs(1)
    out = POLICY_LOSSES["ppo_clip"](inp, cfg)
    loss, clipped, rho = ref_ppo(inp, cfg)
    w, wclip = ref_tis(inp, cfg)
    m = np_(inp.mask)
    np.testing.assert_allclose(np_(out.loss), loss * w * m, atol=1e-6)
    np.testing.assert_allclose(np_(out.metrics["clipped"]), clipped * m, atol=0)
    np.testing.assert_allclose(np_(out.metrics["ratio"]), rho * m, atol=1e-6)
    np.testing.assert_allclose(np_(out.metrics["tis_weight"]), w * m, atol=1e-6)
    np.testing.assert_allclose(np_(out.metrics["tis_clipped"]), wclip * m, atol=0)
    if tis_mode != "off":
        assert 0 < (wclip * m).sum() < m.sum(), "the test should exercise both capped and uncapped weights"


def test_ppo_clip_gradient_is_minus_advantage_ratio_weight_on_unclipped_tokens():
    cfg = AlgorithmConfig(tis_mode="token", tis_cap=1.5)
    inp = make_inputs(2)
    POLICY_LOSSES["ppo_clip"](inp, cfg).loss.sum().backward()
    loss, clipped, rho = ref_ppo(inp, cfg)
    w, _ = ref_tis(inp, cfg)
    expected = -np_(inp.advantages) * rho * w * np_(inp.mask) * (1 - clipped)
    np.testing.assert_allclose(inp.logp.grad.numpy(), expected, atol=1e-6)


def test_clip_higher_uses_the_asymmetric_upper_bound():
    inp = make_inputs(3, behaviour=False)
    inp.logp = torch.full((B, T), math.log(1.25), dtype=torch.float64) + inp.old_logp
    inp.advantages = torch.ones(B, T, dtype=torch.float64)
    sym = POLICY_LOSSES["ppo_clip"](inp, AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.2))
    higher = POLICY_LOSSES["clip_higher"](inp, AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    m = inp.mask
    torch.testing.assert_close(sym.loss, -1.2 * m)  # clipped at 1 + 0.2
    torch.testing.assert_close(higher.loss, -1.25 * m)  # inside 1 + 0.28: not clipped
    assert torch.equal(sym.metrics["clipped"], m) and higher.metrics["clipped"].sum() == 0


def test_dual_clip_bounds_the_loss_of_negative_advantages_by_c():
    cfg = AlgorithmConfig(dual_clip_c=3.0, tis_mode="off")
    inp = make_inputs(4, spread=1.5)
    out = POLICY_LOSSES["dual_clip"](inp, cfg)
    loss, clipped, _ = ref_ppo(inp, cfg)
    a = np_(inp.advantages)
    expected = np.where(a < 0, np.minimum(loss, -3.0 * a), loss)
    dual = ((a < 0) & (-3.0 * a < loss)).astype(np.float64)
    m = np_(inp.mask)
    np.testing.assert_allclose(np_(out.loss), expected * m, atol=1e-6)
    np.testing.assert_allclose(np_(out.metrics["dual_clipped"]), dual * m, atol=0)
    assert (dual * m).sum() > 0, "the test should exercise the dual clip"


def ref_gspo_seq_loss(logp, old, adv_B, mask, cfg):
    """GSPO as written in the paper, per sequence, in torch (for autograd)."""
    n = mask.sum(1)
    s = torch.exp(((logp - old) * mask).sum(1) / n)
    return torch.maximum(-adv_B * s, -adv_B * s.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high))


def test_gspo_with_seq_mean_token_mean_equals_the_sequence_objective_and_its_gradient():
    cfg = AlgorithmConfig(clip_eps_low=0.05, clip_eps_high=0.08, tis_mode="off")
    inp = make_inputs(5, spread=0.1)
    out = POLICY_LOSSES["gspo"](inp, cfg)
    total = aggregate_loss(out.loss, inp.mask, "seq-mean-token-mean", inp.mask.sum(), B, T)
    (grad,) = torch.autograd.grad(total, inp.logp)
    logp2 = inp.logp.detach().clone().requires_grad_(True)
    ref = ref_gspo_seq_loss(logp2, inp.old_logp, inp.advantages[:, 0], inp.mask, cfg).mean()
    (ref_grad,) = torch.autograd.grad(ref, logp2)
    torch.testing.assert_close(total, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, ref_grad * inp.mask, atol=1e-6, rtol=0)
    seq_clipped = out.metrics["clipped"].amax(1)
    assert 0 < seq_clipped.sum() < B, "the test should exercise clipped and unclipped sequences"


def ref_gmpo_seq_loss(logp, old, adv_B, mask, eps):
    lr = logp - old
    sgn = torch.sign(adv_B)[:, None]
    l = sgn * torch.minimum(sgn * lr, sgn * lr.clamp(-eps, eps))
    return -adv_B * torch.exp((l * mask).sum(1) / mask.sum(1))


def test_gmpo_value_and_gradient_match_the_geometric_mean_objective():
    cfg = AlgorithmConfig(gmpo_clip_eps=0.4, tis_mode="off")
    inp = make_inputs(6, spread=0.5)
    out = POLICY_LOSSES["gmpo"](inp, cfg)
    # value: a NumPy geometric mean of per-token clipped ratios
    rho = np.exp(np_(inp.logp) - np_(inp.old_logp))
    a = np_(inp.advantages)[:, 0]
    m = np_(inp.mask)
    for i in range(B):
        toks = [rho[i, t] for t in range(T) if m[i, t] > 0]
        clipped = [min(r, math.exp(0.4)) if a[i] > 0 else max(r, math.exp(-0.4)) for r in toks]
        geo = math.prod(clipped) ** (1 / len(toks))
        np.testing.assert_allclose(np_(out.loss)[i], -a[i] * geo * m[i], atol=1e-6)
    total = aggregate_loss(out.loss, inp.mask, "seq-mean-token-mean", inp.mask.sum(), B, T)
    (grad,) = torch.autograd.grad(total, inp.logp)
    logp2 = inp.logp.detach().clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(ref_gmpo_seq_loss(logp2, inp.old_logp, inp.advantages[:, 0], inp.mask, 0.4).mean(), logp2)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    assert 0 < (np_(out.metrics["clipped"]) * m).sum() < m.sum()


def test_cpg_is_clipped_log_ratio_policy_gradient_plus_policy_drift():
    cfg = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.2, cpg_drift_coef=0.1, tis_mode="off")
    inp = make_inputs(7)
    out = POLICY_LOSSES["cpg"](inp, cfg)
    lr = np_(inp.logp) - np_(inp.old_logp)
    a = np_(inp.advantages)
    pg = np.maximum(-a * lr, -a * np.clip(lr, math.log(0.8), math.log(1.2)))
    drift = np.exp(lr) - 1 - lr
    m = np_(inp.mask)
    np.testing.assert_allclose(np_(out.loss), (pg + 0.1 * drift) * m, atol=1e-6)
    assert (drift * m >= 0).all()


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_gives_zero_and_finite_values_outside_the_mask_even_with_nan_padding(name):
    inp = make_inputs(8)
    pad = inp.mask == 0
    inp.logp = inp.logp.detach().masked_fill(pad, float("nan")).requires_grad_(True)
    inp.behaviour_logp = inp.behaviour_logp.masked_fill(pad, float("nan"))
    out = POLICY_LOSSES[name](inp, AlgorithmConfig())
    assert out.loss.shape == (B, T) and torch.isfinite(out.loss).all()
    assert torch.equal(out.loss[pad], torch.zeros(int(pad.sum()), dtype=out.loss.dtype))
    for key, value in out.metrics.items():
        assert value.shape == (B, T) and torch.isfinite(value).all(), key
        assert not value.requires_grad, key


def test_on_policy_inputs_give_unit_ratio_and_no_clipping():
    inp = make_inputs(9, behaviour=False)
    inp.logp = inp.old_logp.clone().requires_grad_(True)
    out = POLICY_LOSSES["ppo_clip"](inp, AlgorithmConfig())
    torch.testing.assert_close(out.loss, -inp.advantages * inp.mask)
    assert out.metrics["clipped"].sum() == 0 and torch.equal(out.metrics["tis_weight"], inp.mask)
