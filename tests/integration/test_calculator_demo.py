"""The calculator demo (pipelines/calculator, issue 18), shortened: a supervised warm-up on tool-using and
direct-answer traces, then GRPO over multi-turn episodes through the `streamrft train` runtime (ToolEnvironment's
calculator, observation tokens masked out of the loss).

Acceptance: held-out accuracy with tools (greedy episodes) rises by at least 15 points, and it does so because
the model calls the tool more often."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# in pytest's own process, one thread: `make test` runs it in the unit group (tests/conftest.py)
pytestmark = pytest.mark.one_process
CONFIG = Path(__file__).resolve().parents[2] / "pipelines" / "calculator" / "config.yaml"
STEPS = 10


@pytest.mark.slow
def test_calculator_demo_learns_to_call_the_tool(tmp_path):
    from pipelines.calculator.demo import run_demo

    out = tmp_path / "calculator"
    # 10 RL steps: 0.45 -> 0.80 measured, as with 20 (0.78-0.80); the 1000-step warm-up (config.yaml) stays: after
    # 700 steps the model starts at 0.54 and RL adds only 14-15 points, after 400 it cannot use the results
    result = run_demo(str(CONFIG), [f"model.path={out}/sft", f"data.train_path={out}/train.jsonl",
                                    f"output_dir={out}/rl", f"train.max_steps={STEPS}"], n_eval=100)
    before, after = result["before"], result["after"]
    assert result["steps"] == STEPS and before["n"] == after["n"] == 100
    assert after["accuracy"] >= before["accuracy"] + 0.15, result
    assert after["tool_call_rate"] > before["tool_call_rate"], result
    # Step 1 is on-policy: the learner's log-probs of the model tokens equal the engine's (observation tokens
    # are masked out; a mask off by one token, or tool-result tokens in the ratio, would move this off 1).
    first = json.loads((out / "rl" / "steps.jsonl").read_text().splitlines()[0])
    assert abs(first["ratio_mean"] - 1.0) < 1e-3, first
