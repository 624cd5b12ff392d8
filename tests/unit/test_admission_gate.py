"""The admission gate and the per-step accounting of the long-lived pipeline (pure logic)."""

from __future__ import annotations

import asyncio

import pytest

from streamrft.config import ConfigError, load_config, validate_config
from streamrft.runtime.accounting import Accounting, AccountingError
from streamrft.runtime.async_placement import overlap_seconds, union
from streamrft.runtime.gate import AdmissionGate, max_groups_in_flight


def test_groups_in_flight_come_from_the_credits_of_one_inbox():
    assert max_groups_in_flight(256, 8) == 32
    assert max_groups_in_flight(8, 8) == 1
    assert max_groups_in_flight(5, 8) == 1  # never zero: one group always fits


def test_gate_admits_step_k_only_within_max_staleness_of_the_engine_version():
    gate = AdmissionGate(max_staleness=1, max_in_flight=4, version=3)
    assert gate.blocked_by(3) == "paused"
    gate.open = True
    assert gate.blocked_by(3) == "" and gate.blocked_by(4) == ""
    assert gate.blocked_by(5) == "staleness"  # 5 - 3 > 1
    gate.admit(4)
    assert gate.blocked_by(3) == "in_flight" and gate.room() == 0


def test_gate_wait_returns_when_the_version_moves_and_a_group_resolves():
    async def scenario():
        gate = AdmissionGate(max_staleness=0, max_in_flight=2, version=0)
        await gate.set_open(True)
        gate.admit(2)
        waiter = asyncio.create_task(gate.wait_admissible(1))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await gate.release(1)  # room, but step 1 needs version 1
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await gate.set_version(1)
        return await asyncio.wait_for(waiter, 1.0)

    assert asyncio.run(scenario()) == 1


def test_gate_rejects_negative_staleness():
    with pytest.raises(ValueError, match="max_staleness=-1"):
        AdmissionGate(max_staleness=-1, max_in_flight=1)


def test_accounting_checks_each_step_with_later_steps_in_flight():
    acct = Accounting()
    acct.admit(4, step=0)
    acct.admit(4, step=1)  # admitted early (max_staleness=1)
    acct.filter("overlong", 1, step=1)  # a later-step sample settles before step 0 trains
    acct.train(4, step=0)
    acct.check(0)  # step 0 settled; 3 samples of step 1 in flight
    assert acct.in_flight == 3
    assert acct.state_dict()["admitted"] == 5  # a checkpoint leaves the in-flight samples out
    with pytest.raises(AccountingError, match="in flight"):
        acct.check(1)


def test_accounting_names_a_lost_sample():
    acct = Accounting(rank=1)
    acct.admit(4, step=0)
    acct.train(3, step=0)
    with pytest.raises(AccountingError, match="rank 1 step 0"):
        acct.check(0)


def test_overlap_of_interval_sets():
    assert union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    # engine busy 0-3 and 5-6, learner busy 2-5.5: both busy 2-3 and 5-5.5
    assert overlap_seconds([(0, 2), (1, 3), (5, 6)], [(2, 5.5)]) == pytest.approx(1.5)
    assert overlap_seconds([], [(0, 1)]) == 0.0


@pytest.mark.parametrize("override, message", [
    ("rollout.max_staleness=-1", "rollout.max_staleness=-1 must be >= 0"),
    ("rollout.engine_ranks=0", "rollout.engine_ranks=0 must be >= 1"),
    ("rollout.engine_ranks=2", "applies to rollout.placement=async only"),
    ("rollout.placement=async engine.type=vllm", "engine.type='vllm' is not supported there yet"),
    ("rollout.placement=async algorithm.dynamic_sampling=true", "needs rollout.placement=colocated"),
    ("rollout.placement=async rollout.engine_ranks=3", "not divisible by rollout.engine_ranks=3"),
])
def test_settings_that_cannot_work_are_config_errors_before_anything_starts(override, message, tmp_path):
    cfg = load_config("pipelines/arith/config.yaml", override.split() + ["rollout.prompts_per_step=32"])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        validate_config(cfg, 1, check_paths=False)
