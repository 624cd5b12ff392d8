"""Off-policy corrections (issue 15 item 5) against plain-Python float64 formulas, on ragged masks.

Behaviour policy = the engine's sampling log-probs; proximal policy = the learner's old log-probs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamrft.algorithms import OFFPOLICY_MASKS, POLICY_LOSSES, TIS_WEIGHTS, PolicyLossInputs, offpolicy_weight
from streamrft.algorithms.validate import validate_algorithm
from streamrft.config import Config, ConfigError
from streamrft.config.algorithm import AlgorithmConfig
from streamrft.config.engine import EngineConfig
from streamrft.config.rollout import RolloutConfig

LENGTHS = [6, 2, 5, 1, 4, 6, 3]
T = 6


def batch(seed: int = 0, spread: float = 0.6):
    """(proximal, behaviour, mask) float64 with behaviour = proximal + noise; row 5 on-policy."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS], dtype=torch.float64)
    prox = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    beh = prox + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    beh[5] = prox[5]
    beh[mask == 0] = 7.0  # padding garbage must not matter
    return prox, beh, mask


def rows(x, mask):
    """Response values per row, plain Python floats."""
    return [[float(x[i, t]) for t in range(T) if mask[i, t] > 0] for i in range(x.shape[0])]


def ref_weights(prox, beh, mask, tis_mode, cap, mask_mode, low, high):
    """Per-row lists: (w, tis_clipped, masked, kl) from the formulas, one token at a time."""
    out = []
    for p_row, b_row in zip(rows(prox, mask), rows(beh, mask)):
        log_r = [p - b for p, b in zip(p_row, b_row)]
        if tis_mode == "token":
            w = [min(math.exp(x), cap) for x in log_r]
            clipped = [1.0 if math.exp(x) > cap else 0.0 for x in log_r]
        elif tis_mode == "sequence":
            prod = math.exp(sum(log_r))
            w, clipped = [min(prod, cap)] * len(log_r), [1.0 if prod > cap else 0.0] * len(log_r)
        else:
            w, clipped = [1.0] * len(log_r), [0.0] * len(log_r)
        if mask_mode == "token":
            keep = [1.0 if low <= math.exp(x) <= high else 0.0 for x in log_r]
        elif mask_mode == "sequence":
            geo = math.exp(sum(log_r) / len(log_r)) if log_r else 1.0
            keep = [1.0 if low <= geo <= high else 0.0] * len(log_r)
        else:
            keep = [1.0] * len(log_r)
        kl = [math.exp(x) - 1 - x for x in log_r]
        out.append(([wi * ki for wi, ki in zip(w, keep)], clipped, [1 - k for k in keep], kl, w))
    return out


def cfg_of(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(**kw)


@pytest.mark.parametrize("tis_mode", ["token", "sequence", "off"])
@pytest.mark.parametrize("mask_mode", ["token", "sequence", "off"])
def test_offpolicy_weight_is_tis_times_the_trust_window_mask(tis_mode, mask_mode):
    prox, beh, mask = batch(seed=1)
    low, high = (0.5, 1.6) if mask_mode != "off" else (0.5, 5.0)
    cfg = cfg_of(tis_mode=tis_mode, tis_cap=1.8, offpolicy_mask=mask_mode, offpolicy_mask_low=low,
                 offpolicy_mask_high=high)
    w, metrics = offpolicy_weight(prox, beh, mask, cfg)
    ref = ref_weights(prox, beh, mask, tis_mode, 1.8, mask_mode, low, high)
    for i, (rw, rclip, rmasked, rkl, rtis) in enumerate(ref):
        n = LENGTHS[i]
        np.testing.assert_allclose(w[i, :n].numpy(), rw, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(metrics["tis_weight"][i, :n].numpy(), rtis, rtol=1e-12)
        assert metrics["tis_clipped"][i, :n].tolist() == rclip
        assert metrics["offpolicy_masked"][i, :n].tolist() == rmasked
        np.testing.assert_allclose(metrics["behaviour_proximal_kl"][i, :n].numpy(), rkl, rtol=1e-10, atol=1e-14)
        assert metrics["offpolicy_masked"][i, n:].abs().sum() == 0 and metrics["behaviour_proximal_kl"][i, n:].abs().sum() == 0
    assert metrics["offpolicy_masked"][5].sum() == 0, "an on-policy row is never masked"
    if mask_mode != "off":
        # the window is not vacuous here: something is dropped and something is kept
        assert 0 < metrics["offpolicy_masked"].sum() < mask.sum()


def test_sequence_masking_uses_the_geometric_mean_and_drops_whole_sequences():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    prox = torch.zeros(3, 4, dtype=torch.float64)
    # row 0: one token at ratio e^2 (alone out of [0.5, 2]) but geometric mean e^(2/3) = 1.95: kept
    # row 1: geometric mean e^(0.8) = 2.23: the whole row dropped, though two tokens are at ratio 1
    # row 2: ratios 0.9 and 1.2: kept; padding at ratio e^-50 is ignored
    log_r = torch.tensor([[2.0, 0.0, 0.0, 9.0], [0.0, 0.0, 1.6, 1.6], [math.log(0.9), math.log(1.2), -50.0, -50.0]],
                         dtype=torch.float64)
    beh = prox - log_r
    keep_seq = OFFPOLICY_MASKS["sequence"](log_r * mask, mask, 0.5, 2.0)
    keep_tok = OFFPOLICY_MASKS["token"](log_r * mask, mask, 0.5, 2.0)
    assert keep_seq.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    assert keep_tok.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    _, metrics = offpolicy_weight(prox, beh, mask, cfg_of(offpolicy_mask="sequence", offpolicy_mask_low=0.5,
                                                          offpolicy_mask_high=2.0))
    assert metrics["offpolicy_masked"].sum().item() == 4.0


def test_low_zero_is_masked_importance_sampling_without_a_lower_bound():
    log_r = torch.tensor([[-30.0, 0.0, 3.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    assert OFFPOLICY_MASKS["token"](log_r, mask, 0.0, 5.0).tolist() == [[1.0, 1.0, 0.0]]


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cpg"])
def test_the_policy_loss_is_multiplied_by_the_detached_correction(name):
    prox, beh, mask = batch(seed=2)
    g = torch.Generator().manual_seed(3)
    logp = (prox + 0.1 * torch.randn(prox.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(len(LENGTHS), 1, generator=g, dtype=torch.float64).expand_as(prox)
    cfg = cfg_of(tis_mode="token", tis_cap=1.5, offpolicy_mask="token", offpolicy_mask_low=0.6, offpolicy_mask_high=1.7)
    plain_cfg = cfg_of(tis_mode="off")
    out = POLICY_LOSSES[name](PolicyLossInputs(logp, prox, adv, mask, beh), cfg)
    plain = POLICY_LOSSES[name](PolicyLossInputs(logp, prox, adv, mask, None), plain_cfg)
    ref = ref_weights(prox, beh, mask, "token", 1.5, "token", 0.6, 1.7)
    w = torch.zeros_like(prox)
    for i, (rw, *_rest) in enumerate(ref):
        w[i, : LENGTHS[i]] = torch.tensor(rw, dtype=torch.float64)
    torch.testing.assert_close(out.loss, plain.loss * w, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    (plain_grad,) = torch.autograd.grad(plain.loss.sum(), logp)
    torch.testing.assert_close(grad, plain_grad * w, rtol=1e-12, atol=1e-12)
    masked = out.metrics["offpolicy_masked"] > 0
    assert 0 < masked.sum() < mask.sum()
    assert (grad[masked] == 0).all(), "a masked token pushes nothing"


def test_no_behaviour_logprobs_means_no_correction():
    prox, _, mask = batch()
    w, metrics = offpolicy_weight(prox, None, mask, cfg_of(offpolicy_mask="token"))
    assert torch.equal(w, torch.ones_like(prox))
    assert metrics["offpolicy_masked"].sum() == 0 and metrics["behaviour_proximal_kl"].sum() == 0


def test_the_kl_is_finite_for_a_wild_behaviour_logprob_and_tis_never_overflows():
    prox = torch.tensor([[-0.1, -0.2, -0.3]], dtype=torch.float32)
    beh = torch.tensor([[-1e4, -0.2, -300.0]], dtype=torch.float32)
    mask = torch.ones(1, 3)
    w, metrics = offpolicy_weight(prox, beh, mask, cfg_of(tis_mode="sequence"))
    assert torch.isfinite(metrics["behaviour_proximal_kl"]).all() and metrics["behaviour_proximal_kl"][0, 1] == 0
    assert w.tolist() == [[2.0, 2.0, 2.0]]
    w_tok, _ = offpolicy_weight(prox, beh, mask, cfg_of(tis_mode="token", offpolicy_mask="token"))
    assert w_tok.tolist() == [[0.0, 1.0, 0.0]]


def test_tis_weights_and_masks_are_chosen_by_name():
    assert set(TIS_WEIGHTS) == {"token", "sequence", "off"}
    assert set(OFFPOLICY_MASKS) == {"token", "sequence", "off"}


# --- configuration ---------------------------------------------------------------------------------

def cfg_with(**algo) -> Config:
    return Config(algorithm=AlgorithmConfig(**algo), rollout=RolloutConfig(n_samples_per_prompt=8),
                  engine=EngineConfig(max_new_tokens=32))


def test_the_icepop_and_mis_recipes_are_valid():
    validate_algorithm(cfg_with(offpolicy_mask="token", offpolicy_mask_low=0.5, offpolicy_mask_high=5.0, tis_cap=5.0))
    validate_algorithm(cfg_with(offpolicy_mask="sequence", offpolicy_mask_low=0.0, offpolicy_mask_high=2.0))
    validate_algorithm(cfg_with(policy_loss="gmpo", gmpo_clip_eps=0.3, offpolicy_mask="token"))


CASES = [
    (dict(offpolicy_mask="icepop"), "algorithm.offpolicy_mask='icepop' is unknown; choose one of: off, sequence, token"),
    (dict(offpolicy_mask="token", offpolicy_mask_low=1.0),
     "algorithm.offpolicy_mask_low=1.0 must be in [0, 1) (a ratio of 1, on-policy, must be kept)"),
    (dict(offpolicy_mask="token", offpolicy_mask_low=-0.1),
     "algorithm.offpolicy_mask_low=-0.1 must be in [0, 1) (a ratio of 1, on-policy, must be kept)"),
    (dict(offpolicy_mask="sequence", offpolicy_mask_high=1.0),
     "algorithm.offpolicy_mask_high=1.0 must be > 1 (a ratio of 1, on-policy, must be kept)"),
]


@pytest.mark.parametrize("algo,message", CASES)
def test_invalid_offpolicy_settings_are_config_errors(algo, message):
    with pytest.raises(ConfigError) as err:
        validate_algorithm(cfg_with(**algo))
    assert str(err.value) == message


def _owned(key, owner, current, values):
    return (f"algorithm.{key} is set but algorithm.{owner}={current!r}; it applies only to algorithm.{owner} in "
            f"{values!r}; remove algorithm.{key} or change algorithm.{owner}")


_PPO_LIKE = ("ppo_clip", "clip_higher", "dual_clip", "gspo", "cpg")
UNUSED = [
    (["algorithm.offpolicy_mask_low=0.2"], _owned("offpolicy_mask_low", "offpolicy_mask", "off", ("token", "sequence"))),
    (["algorithm.offpolicy_mask_high=3.0"], _owned("offpolicy_mask_high", "offpolicy_mask", "off", ("token", "sequence"))),
    (["algorithm.policy_loss=gmpo", "algorithm.clip_eps_high=0.28"],
     _owned("clip_eps_high", "policy_loss", "gmpo", _PPO_LIKE)),
    (["algorithm.policy_loss=gmpo", "algorithm.clip_eps_low=0.2"], _owned("clip_eps_low", "policy_loss", "gmpo", _PPO_LIKE)),
]


@pytest.mark.parametrize("overrides,message", UNUSED)
def test_settings_that_do_nothing_for_the_selected_variant_are_config_errors(overrides, message):
    """The window of an unselected offpolicy_mask, and PPO's clip range with gmpo (its own gmpo_clip_eps)."""
    from streamrft.config import load_config, validate_config
    from tests.integration.conftest import REPO

    cfg = load_config(REPO / "pipelines" / "arith" / "config.yaml", overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=1, check_paths=False)
    assert str(err.value) == message


def test_off_written_in_yaml_or_an_override_is_the_word_not_a_boolean(tmp_path):
    from streamrft.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  tis_mode: off\n  offpolicy_mask: token\ntrain:\n  packing: true\n")
    cfg = load_config(path, ["algorithm.offpolicy_mask=off"])
    assert (cfg.algorithm.tis_mode, cfg.algorithm.offpolicy_mask, cfg.train.packing) == ("off", "off", True)


def test_the_kl_near_on_policy_is_accurate_and_never_negative_in_float32():
    x = torch.tensor([[1e-6, -3e-6, 2e-5, 0.0, -1e-3]], dtype=torch.float32)
    _, metrics = offpolicy_weight(x, torch.zeros_like(x), torch.ones_like(x), cfg_of())
    got = metrics["behaviour_proximal_kl"][0].double().numpy()
    ref = np.array([math.expm1(float(v)) - float(v) for v in x[0].double()])
    assert (got >= 0).all()
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-15)
