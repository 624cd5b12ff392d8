"""Off-policy correction end to end (issue 15 item 5): the arith pipeline with samples one version
stale and token masking of a narrow trust window reports offpolicy_masked_fraction and
behaviour_proximal_kl in steps.jsonl (the per-step metrics) and trains without NaN."""

from __future__ import annotations

import json
import math

import pytest

from streamrft.config import load_config
from tests.integration.conftest import REPO, arith_overrides

pytestmark = pytest.mark.slow
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_stale_samples_are_masked_and_the_behaviour_proximal_kl_is_reported(arith_dir, tmp_path, mode):
    from streamrft.compose import train

    cfg = load_config(CONFIG, arith_overrides(
        arith_dir, tmp_path, "train.max_steps=4", "data.eval_path=", "train.lr=3e-3", "rollout.max_staleness=1",
        f"algorithm.offpolicy_mask={mode}", "algorithm.offpolicy_mask_low=0.98", "algorithm.offpolicy_mask_high=1.02",
    ))
    train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 4
    for s in steps:
        assert all(math.isfinite(v) for v in s.values()), s
        assert 0.0 <= s["offpolicy_masked_fraction"] <= 1.0
        assert s["behaviour_proximal_kl"] >= 0.0
    # after the first update the engine lags the learner: the window drops tokens and the KL is > 0
    assert max(s["behaviour_proximal_kl"] for s in steps) > 0
    assert max(s["offpolicy_masked_fraction"] for s in steps) > 0
