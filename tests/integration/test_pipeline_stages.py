"""The streaming pipeline inside one rank: streaming, phase switches, accounting, failed samples."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamrft.config import load_config, validate_config
from streamrft.runtime.stage import StageError
from tests.integration.conftest import REPO, arith_overrides

pytestmark = pytest.mark.slow
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"

SCORE_TIMES: list[float] = []


def recording_reward(response: str, reference: str) -> float:
    """Custom reward that records when each sample was scored (wall clock, perf_counter)."""
    SCORE_TIMES.append(time.perf_counter())
    time.sleep(0.01)
    return float(response.strip().split(" ")[0] == reference) if response.strip() else 0.0


def flaky_reward(response: str, reference: str) -> float:
    """Raises for every sample whose answer starts with 1: those samples must fail, counted."""
    if response.strip().startswith("1"):
        raise ValueError("refusing answers that start with 1")
    return 1.0 if response.strip() == reference else 0.0


class RecordingEngine:
    """Wraps the real engine and records when each sample's generation ended (it is yielded)."""

    def __init__(self, engine):
        self.engine = engine
        self.yield_times: list[float] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, requests, mm_inputs=None):
        async for out in self.engine.generate(requests, mm_inputs):
            self.yield_times.append(time.perf_counter())
            yield out


def build(arith_dir, out, *extra):
    from streamrft.runtime.distributed import init_distributed
    from streamrft.compose import build_run

    cfg = load_config(CONFIG, arith_overrides(arith_dir, out, *extra))
    dist = init_distributed()
    validate_config(cfg, dist.world_size)
    return build_run(cfg, dist)


async def run_loop(run):
    """The driver's train loop, then its shutdown (sockets, sinks, scorer) whatever happened."""
    from streamrft.runtime.driver import _shutdown, train_loop

    try:
        return await train_loop(run)
    finally:
        await _shutdown(run)


def test_first_sample_is_scored_before_the_last_generation_of_the_step_ends(arith_dir, tmp_path):
    run = build(arith_dir, tmp_path, "reward.sources=[{name: exact, type: custom, fn: tests.integration.test_pipeline_stages:recording_reward}]",
                "engine.max_batch_size=4", "data.eval_path=")
    recorder = RecordingEngine(run.engine)
    run.pipeline.engine = recorder
    SCORE_TIMES.clear()

    asyncio.run(run_loop(run))
    assert len(recorder.yield_times) == 32 and len(SCORE_TIMES) == 32
    assert min(SCORE_TIMES) < max(recorder.yield_times), "scoring waited for the whole step's generation"


def test_phase_switches_follow_the_colocated_sequence(arith_dir, tmp_path):
    run = build(arith_dir, tmp_path, "train.max_steps=2", "data.eval_path=")

    asyncio.run(run_loop(run))
    to_rollout = ["offload", "weight_push", "unshard", "wake"]
    to_train = ["decide", "drain", "sleep", "reshard", "reload"]
    assert run.phase.events == to_rollout + (to_train + to_rollout) * 2
    assert run.engine.policy_version == 2
    for part in ("sleep", "wake", "weight_push", "rollout_to_train", "train_to_rollout"):
        assert run.phase.timings[part] >= 0.0


def test_a_reward_function_that_raises_fails_those_samples_and_the_run_goes_on(arith_dir, tmp_path):
    # about half the samples fail (answers starting with 1): under the failure policy's default 0.5 limit
    # a step could stop the run, which tests/unit/test_failure_policy.py covers; here the run must go on
    run = build(arith_dir, tmp_path, "train.max_steps=2", "data.eval_path=", "reward.max_failed_fraction=0.9",
                "reward.sources=[{name: exact, type: custom, fn: tests.integration.test_pipeline_stages:flaky_reward}]")

    summary = asyncio.run(run_loop(run))
    acct = run.accounting
    assert acct.admitted == 2 * 32
    assert sum(acct.failed.values()) > 0, "the flaky reward never raised: pick another rule"
    assert acct.admitted == acct.trained + sum(acct.filtered.values()) + sum(acct.failed.values())
    assert summary["samples_trained"] == acct.trained


def test_fail_fast_stops_the_run_naming_the_sample(arith_dir, tmp_path):
    run = build(arith_dir, tmp_path, "fail_fast=true", "data.eval_path=",
                "reward.sources=[{name: exact, type: custom, fn: tests.integration.test_pipeline_stages:flaky_reward}]")

    with pytest.raises(StageError, match=r"stage reward on rank 0: sample s0-p\d+-\d+ failed: .*fail_fast"):
        asyncio.run(run_loop(run))


def test_a_prompt_over_max_prompt_tokens_fails_its_samples_naming_the_row_and_the_run_goes_on(arith_dir, tmp_path):
    run = build(arith_dir, tmp_path, "train.max_steps=2", "data.eval_path=", "data.max_prompt_tokens=5")

    asyncio.run(run_loop(run))
    acct = run.accounting
    assert acct.failed["data_error"] > 0 and acct.trained > 0  # "12+34=" is 6 tokens, "1+2=" is 4
    assert acct.admitted == acct.trained + sum(acct.filtered.values()) + sum(acct.failed.values())
