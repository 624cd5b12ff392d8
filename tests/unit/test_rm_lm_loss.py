"""The SRM's auxiliary LM loss on the chosen answer, against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from streamrft.config.base import ConfigError
from streamrft.rm.config import load_rm_config, validate_rm_config
from streamrft.rm.train import chosen_lm_loss


def test_chosen_lm_loss_averages_the_nll_of_response_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3, 4], [1, 3, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    prompt_len = torch.tensor([2, 1])
    # Row 0 predicts positions 2 and 3; row 1 predicts positions 1 and 2 (position 3 is padding).
    terms = []
    for b, positions in ((0, (2, 3)), (1, (1, 2))):
        for t in positions:
            logp = logits[b, t - 1] - torch.logsumexp(logits[b, t - 1], 0)
            terms.append(-logp[ids[b, t]].item())
    assert chosen_lm_loss(logits, ids, mask, prompt_len).item() == pytest.approx(sum(terms) / len(terms), abs=1e-12)
    assert math.isfinite(chosen_lm_loss(logits, ids, torch.zeros_like(mask), prompt_len).item())


def test_a_negative_lm_coef_is_a_config_error(tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text("kind: srm\n")
    with pytest.raises(ConfigError, match="lm_coef"):
        validate_rm_config(load_rm_config(path, ["train.lm_coef=-1"]), check_paths=False)
