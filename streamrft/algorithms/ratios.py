"""Importance ratios that stay finite in float32.

exp(x) overflows float32 past x ~ 88.7, and once a ratio is inf the flat (clipped) branch of a
surrogate back-propagates 0 * inf = NaN into every parameter: one token poisons the whole update.
Every ratio in ``streamrft.algorithms`` is therefore taken as exp(min(x, LOG_RATIO_CAP)).

LOG_RATIO_CAP = 20 (a ratio of 4.85e8) rather than ~88: the unclipped branch -A * rho of a token
with A < 0 is a loss of |A| rho, and e^88 times any |A| > 2 (or summed over a few tokens) is inf
again. Past the cap the ratio is held at e^20 with zero gradient (torch.clamp passes no gradient
outside its range), i.e. the token counts as clipped: its loss is finite and it pushes nothing.
Below the cap every formula is the paper's, unchanged. Only the upper side is capped: exp of a very
negative number underflows to 0, which is exact enough and has a finite (zero) gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CAP = 20.0


def bounded_exp(log_ratio: Tensor) -> Tensor:
    """exp(min(x, LOG_RATIO_CAP)): equal to exp(x) (value and gradient) for x <= cap, e^cap with zero
    gradient above it; never inf or NaN for finite or +inf x."""
    return torch.exp(log_ratio.clamp(max=LOG_RATIO_CAP))


def over_cap(log_ratio: Tensor) -> Tensor:
    """Where bounded_exp held the ratio at the cap (bool, detached)."""
    return log_ratio.detach() > LOG_RATIO_CAP
