"""Pure tensor functions of the algorithm matrix, picked by name from explicit dicts.

ADVANTAGE_ESTIMATORS[algorithm.advantage_estimator] -> Estimator(fn, scope, needs_critic)
POLICY_LOSSES[algorithm.policy_loss]                -> fn(PolicyLossInputs, cfg) -> PolicyLossOutput
KL_ESTIMATORS[algorithm.kl_estimator]               -> fn(logp_BT, ref_logp_BT) -> kl_BT
TIS_WEIGHTS[algorithm.tis_mode]                     -> fn(log_r_BT, mask_BT, cap) -> (w_BT, clipped_BT)
OFFPOLICY_MASKS[algorithm.offpolicy_mask]           -> fn(log_r_BT, mask_BT, low, high) -> keep_BT
LOSS_AGG_MODES                                      -> the modes aggregate_loss accepts
This package imports only torch and the algorithm config section.
"""

from __future__ import annotations

from typing import Callable

from streamrft.algorithms._masked import identity, pad_rows
from streamrft.algorithms.advantage_types import AdvantageInputs, AdvantageOutputs, Estimator, clip_advantages
from streamrft.algorithms.advantages_batch import gae, reinforce, reinforce_plus_plus, value_loss
from streamrft.algorithms.advantages_group import cpgd, dr_grpo, group_norm, reinforce_baseline, rloo
from streamrft.algorithms.aggregate import LOSS_AGG_MODES, aggregate_loss
from streamrft.algorithms.filters import (
    high_entropy_token_mask,
    overlong_filter,
    overlong_penalty,
    zero_variance_groups,
)
from streamrft.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)
from streamrft.algorithms.logits import entropy_from_logits, entropy_from_logits_chunked, logprobs_from_logits
from streamrft.algorithms.normalize import RunningMeanStd, clip_rewards, whiten_advantages
from streamrft.algorithms.offpolicy import OFFPOLICY_MASKS, TIS_WEIGHTS, behaviour_proximal_kl, offpolicy_weight
from streamrft.algorithms.policy_losses import (
    PolicyLossInputs,
    PolicyLossOutput,
    clip_higher,
    cpg,
    dual_clip,
    gmpo,
    gspo,
    ppo_clip,
    tis_weight,
)
from streamrft.config.algorithm import AlgorithmConfig

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "group_norm": Estimator(group_norm, scope="group"),
    "dr_grpo": Estimator(dr_grpo, scope="group"),
    "rloo": Estimator(rloo, scope="group"),
    "reinforce_baseline": Estimator(reinforce_baseline, scope="group"),
    "cpgd": Estimator(cpgd, scope="group"),
    "reinforce": Estimator(reinforce, scope="batch"),
    "reinforce++": Estimator(reinforce_plus_plus, scope="batch"),
    "gae": Estimator(gae, scope="batch", needs_critic=True),
}



def one_group_advantages(rewards_B, response_lens: list[int], cfg: AlgorithmConfig) -> list:
    """Per-sample advantage vectors (response_len,) of ONE prompt group, from the group-scope estimator
    ``cfg.advantage_estimator`` (the AdvantageStage calls this as each group completes; batch-scope
    estimators run in the learner over the global batch with the same registry)."""
    import torch

    estimator = ADVANTAGE_ESTIMATORS[cfg.advantage_estimator]
    if estimator.scope != "group":
        raise ValueError(f"algorithm.advantage_estimator={cfg.advantage_estimator!r} is batch-scope, not per group")
    _, mask_BT = pad_rows([torch.ones(n) for n in response_lens])
    inputs = AdvantageInputs(rewards=rewards_B.to(torch.float32), group_index=torch.zeros(len(response_lens), dtype=torch.int64),
                             response_mask=mask_BT, token_rewards=None, values=None)
    adv_BT = estimator.fn(inputs, cfg).advantages
    return [adv_BT[i, :n].clone() for i, n in enumerate(response_lens)]


POLICY_LOSSES: dict[str, Callable[[PolicyLossInputs, AlgorithmConfig], PolicyLossOutput]] = {
    "ppo_clip": ppo_clip,
    "clip_higher": clip_higher,
    "dual_clip": dual_clip,
    "gspo": gspo,
    "gmpo": gmpo,
    "cpg": cpg,
}

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "one_group_advantages",
    "POLICY_LOSSES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "OFFPOLICY_MASKS",
    "TIS_WEIGHTS",
    "AdvantageInputs",
    "AdvantageOutputs",
    "Estimator",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMeanStd",
    "aggregate_loss",
    "behaviour_proximal_kl",
    "pad_rows",
    "clip_advantages",
    "clip_rewards",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "high_entropy_token_mask",
    "identity",
    "logprobs_from_logits",
    "make_kl_controller",
    "offpolicy_weight",
    "overlong_filter",
    "overlong_penalty",
    "tis_weight",
    "value_loss",
    "whiten_advantages",
    "zero_variance_groups",
]
