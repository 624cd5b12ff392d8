"""Group-scope advantage estimators: each needs only one complete prompt group.

All take the sequence reward r_i of sample i in group g (n_g samples) and write one advantage on every
response token of the sample (``reinforce_baseline`` adds per-token returns). Groups are found by value
of ``group_index``, so interleaved groups in a batch are fine. Singleton groups get advantage 0.
"""

from __future__ import annotations

import torch

from streamrft.algorithms._masked import discounted_returns, group_stats, identity, mask_out, token_level_rewards
from streamrft.algorithms.advantage_types import AdvantageInputs, AdvantageOutputs, finish
from streamrft.config.algorithm import AlgorithmConfig


def _spread(adv_B: torch.Tensor, inp: AdvantageInputs) -> torch.Tensor:
    return adv_B[:, None].to(inp.rewards.dtype) * inp.response_mask.to(inp.rewards.dtype)  # (B, T)


def group_norm(inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum=identity) -> AdvantageOutputs:
    """GRPO (Shao et al., arXiv:2402.03300): A_i = (r_i - mean_g) / (std_g + eps).

    std_g is the unbiased (Bessel, n_g - 1) std of the group, as torch.std; eps = algorithm.norm_eps.
    Left out: process supervision (per-step rewards).
    """
    mean_B, std_B, _ = group_stats(inp.rewards, inp.group_index)
    adv_B = (inp.rewards - mean_B) / (std_B + cfg.norm_eps)
    return AdvantageOutputs(finish(_spread(adv_B, inp), inp.response_mask, cfg))


def dr_grpo(inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum=identity) -> AdvantageOutputs:
    """Dr. GRPO (Liu et al., arXiv:2503.20783): A_i = r_i - mean_g, no std division.

    Pair with loss_agg_mode=seq-mean-token-sum-norm (validate_algorithm requires it) so no length bias
    comes back through the aggregation either.
    """
    mean_B, _, _ = group_stats(inp.rewards, inp.group_index)
    return AdvantageOutputs(finish(_spread(inp.rewards - mean_B, inp), inp.response_mask, cfg))


def rloo(inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum=identity) -> AdvantageOutputs:
    """RLOO (Ahmadian et al., arXiv:2402.14740): A_i = r_i - (1 / (n_g - 1)) sum_{j != i} r_j.

    Computed as n_g / (n_g - 1) * (r_i - mean_g); a singleton group gives 0.
    """
    mean_B, _, count_B = group_stats(inp.rewards, inp.group_index)
    scale_B = torch.where(count_B > 1, count_B / (count_B - 1).clamp(min=1), torch.zeros_like(count_B))
    return AdvantageOutputs(finish(_spread(scale_B * (inp.rewards - mean_B), inp), inp.response_mask, cfg))


def reinforce_baseline(inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum=identity) -> AdvantageOutputs:
    """REINFORCE with a group-mean baseline (REINFORCE++-baseline, arXiv:2501.03262):

    A_t = G_t - mean_g(r), G_t = sum_{k >= t} gamma^(k-t) (token_rewards_k + r * [k = last]).
    Without token rewards and with gamma = 1 this is r_i - mean_g (same as dr_grpo). The paper's
    global std normalisation is a batch-scope step left out here (use reinforce++ for it).
    """
    mean_B, _, _ = group_stats(inp.rewards, inp.group_index)
    returns_BT = discounted_returns(token_level_rewards(inp.rewards, inp.response_mask, inp.token_rewards), cfg.gamma)
    adv_BT = (returns_BT - mean_B[:, None]).to(returns_BT.dtype)  # group_stats is float64
    return AdvantageOutputs(finish(adv_BT, inp.response_mask, cfg), mask_out(returns_BT, inp.response_mask))


def cpgd(inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum=identity) -> AdvantageOutputs:
    """CPGD advantage (Liu et al., arXiv:2505.12504): group-normalised reward as in GRPO,
    A_i = (r_i - mean_g) / (std_g + eps), to be paired with the ``cpg`` policy loss (clipped log-ratio
    policy gradient plus policy drift). Left out: the paper's optional per-group weighting factor.
    """
    return group_norm(inp, cfg, all_reduce_sum)
