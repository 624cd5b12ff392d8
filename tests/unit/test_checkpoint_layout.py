"""Checkpoint layout: latest resolution, incomplete saves, rotation, steps.jsonl on resume, RNG and counters."""

import json
import random

import numpy as np
import pytest
import torch

from streamrft.checkpoint.layout import (
    META,
    complete_checkpoints,
    latest_checkpoint,
    read_meta,
    remove_incomplete,
    resolve_checkpoint,
    rotate,
    step_dir,
    write_meta,
)
from streamrft.checkpoint.manager import reset_steps_log
from streamrft.checkpoint.rng import rng_state, set_rng_state
from streamrft.config import Config
from streamrft.config.base import ConfigError
from streamrft.config.checkpoint import CheckpointConfig, validate_checkpoint
from streamrft.runtime.accounting import Accounting


def make(out, step, complete=True):
    path = step_dir(out, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if complete:
        write_meta(path, {"step": step})
    return path


def test_step_folders_are_zero_padded_under_checkpoints(tmp_path):
    assert step_dir(tmp_path, 12) == tmp_path / "checkpoints" / "step_00000012"
    with pytest.raises(ValueError, match="step=-1 must be >= 0"):
        step_dir(tmp_path, -1)


def test_latest_is_the_highest_complete_step_and_ignores_saves_without_meta(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    make(tmp_path, 2)
    make(tmp_path, 10)
    make(tmp_path, 11, complete=False)  # interrupted save: never resumed from
    (tmp_path / "checkpoints" / "step_notanumber").mkdir()
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 10)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 10]


def test_rotation_keeps_the_newest_complete_and_drops_older_interrupted_saves(tmp_path):
    for step in (1, 2, 4, 5):
        make(tmp_path, step)
    make(tmp_path, 3, complete=False)  # older than the newest complete: garbage
    make(tmp_path, 6, complete=False)  # newer: could be a save in progress, kept
    removed = rotate(tmp_path, keep=2)
    assert [p.name for p in removed] == ["step_00000001", "step_00000002", "step_00000003"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_00000004", "step_00000005", "step_00000006"]
    assert [p.name for p in remove_incomplete(tmp_path)] == ["step_00000006"]


def test_resolve_accepts_a_step_folder_or_an_output_dir_and_rejects_an_incomplete_one(tmp_path):
    make(tmp_path, 3)
    make(tmp_path, 4, complete=False)
    assert resolve_checkpoint(tmp_path) == step_dir(tmp_path, 3)
    assert resolve_checkpoint(tmp_path / "checkpoints") == step_dir(tmp_path, 3)
    assert resolve_checkpoint(step_dir(tmp_path, 3)) == step_dir(tmp_path, 3)
    with pytest.raises(ValueError, match="step_00000004 is incomplete"):
        resolve_checkpoint(step_dir(tmp_path, 4))
    with pytest.raises(ValueError, match="neither a checkpoint folder"):
        resolve_checkpoint(tmp_path / "nothing")


def test_meta_is_versioned_and_an_unknown_format_is_refused(tmp_path):
    path = make(tmp_path, 1)
    assert read_meta(path) == {"format": 1, "step": 1}
    (path / META).write_text(json.dumps({"format": 99, "step": 1}))
    with pytest.raises(ValueError, match="format=99, this version reads format 1"):
        read_meta(path)


def test_steps_log_is_removed_when_fresh_and_trimmed_to_the_checkpoint_on_resume(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (1, 2, 3, 4)))
    reset_steps_log(log, 2)  # steps 3 and 4 ran after the checkpoint: they run again
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    reset_steps_log(log, 0)
    assert not log.exists()


def test_rng_states_round_trip_through_json():
    state = json.loads(json.dumps(rng_state()))
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123), random.seed(5), np.random.seed(7)
    set_rng_state(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


def test_accounting_counters_round_trip():
    a = Accounting(rank=1)
    a.admit(10), a.train(6), a.filter("zero_std", 3), a.fail("timeout: scorer", 1)
    a.refilled_prompts = 2
    b = Accounting(rank=1)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.summary() == a.summary() and b.settled == 10
    b.check(0)


def test_checkpoint_settings_are_validated_with_the_key_to_fix():
    cfg = Config(checkpoint=CheckpointConfig(keep=0))
    with pytest.raises(ConfigError, match=r"checkpoint.keep=0 must be >= 1"):
        validate_checkpoint(cfg)
    with pytest.raises(ConfigError, match=r"checkpoint.save_every=-1 must be >= 0"):
        validate_checkpoint(Config(checkpoint=CheckpointConfig(save_every=-1)))
