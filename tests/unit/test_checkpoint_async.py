"""checkpoint.async_save with a real FSDP2Strategy at world size 1: the write overlaps the next step,
meta.json stays last, a crash between shards and meta.json leaves the previous checkpoint the latest,
a failed background write fails the run loudly, and a resume from an async checkpoint is bitwise."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from streamrft.checkpoint import complete_checkpoints, latest_checkpoint, read_meta, step_dir
from streamrft.checkpoint.background import BackgroundWriter, CheckpointSaveError
from streamrft.checkpoint.staging import HostStager
from streamrft.config.base import ConfigError
from streamrft.config.checkpoint import async_save_enabled
from tests.unit.test_checkpoint_manager import config, model_dir, parts, train_step, weights  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def test_a_slow_write_overlaps_the_next_train_step_and_meta_comes_last(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=1, async_save=True)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    ckpt.resume({"generator": counter})
    assert ckpt.async_save
    at_meta, release = threading.Event(), threading.Event()

    def slow(point, path):  # the write of step 1 holds before meta.json until step 2 has trained
        if point == "meta" and path == step_dir(tmp_path, 1):
            at_meta.set()
            assert release.wait(30), "the training thread never released the write"

    ckpt.write_hook = slow
    train_step(strategy, accounting, counter, 1)
    assert ckpt.step_done(1, policy_version=1) == step_dir(tmp_path, 1)  # returned while the write is held
    assert at_meta.wait(30)
    assert (step_dir(tmp_path, 1) / ".metadata").is_file()  # every shard is written ...
    assert not (step_dir(tmp_path, 1) / "meta.json").exists()  # ... and the checkpoint is not complete yet
    train_step(strategy, accounting, counter, 2)  # the next step trains meanwhile
    assert latest_checkpoint(tmp_path) is None
    threading.Timer(1.0, release.set).start()  # the write of step 1 ends about 1 s after step 2's save begins
    ckpt.step_done(2, policy_version=2)  # waits for step 1's write, then stages step 2
    assert 0.9 <= ckpt.wait_seconds <= ckpt.stage_seconds, (ckpt.wait_seconds, ckpt.stage_seconds)
    ckpt.wait()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 2]
    meta = read_meta(step_dir(tmp_path, 2))
    assert meta["async_save"] is True and meta["reason"] == "periodic"
    assert ckpt.stage_seconds < meta["save_seconds"]


def test_resume_from_async_checkpoints_is_bitwise(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=2, keep=1, async_save=True)
    a, acc_a, counter_a, ckpt_a = parts(cfg, dist)
    ckpt_a.resume({"generator": counter_a})
    for step in (1, 2):
        train_step(a, acc_a, counter_a, step)
        ckpt_a.step_done(step, policy_version=step)
    # the staged copy is what is written: steps 3-4 change the live weights while step 2 may still be writing
    losses_a = [train_step(a, acc_a, counter_a, step) for step in (3, 4)]
    ckpt_a.wait()

    b, acc_b, counter_b, ckpt_b = parts(cfg, dist)
    resumed = ckpt_b.resume({"generator": counter_b})
    assert (resumed.step, resumed.path) == (2, step_dir(tmp_path, 2))
    assert counter_b.refills_used == 2 and acc_b.trained == 6
    assert [train_step(b, acc_b, counter_b, step) for step in (3, 4)] == losses_a
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_failing_background_write_fails_the_next_step_loudly(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=1, async_save=True)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    ckpt.resume({"generator": counter})
    train_step(strategy, accounting, counter, 1)
    ckpt.step_done(1, policy_version=1)
    ckpt.wait()

    def broken(point, path):
        if point == "shards":
            raise OSError(5, "Input/output error (injected)")

    ckpt.write_hook = broken
    train_step(strategy, accounting, counter, 2)
    ckpt.step_done(2, policy_version=2)  # staged; the write fails in the background
    train_step(strategy, accounting, counter, 3)
    with pytest.raises(CheckpointSaveError) as info:
        ckpt.step_done(3, policy_version=3)
    assert str(info.value) == (
        f"checkpoint {step_dir(tmp_path, 2)}: the background write failed on rank 0: OSError: [Errno 5] "
        "Input/output error (injected) (no shard file from rank(s) 0); it has no meta.json, so the previous "
        "complete checkpoint stays the latest")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
    ckpt.wait()  # the error is raised once; nothing else is in flight


@pytest.mark.slow
def test_a_crash_between_shards_and_meta_leaves_the_previous_checkpoint_latest(model_dir, tmp_path):
    """A real second process saves step 1, then dies (os._exit) after step 2's shards, before its meta.json."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.unit.test_checkpoint_manager import config, parts, train_step
        from streamrft.runtime.distributed import init_distributed
        cfg = config({str(model_dir)!r}, {str(tmp_path)!r}, save_every=1, async_save=True)
        strategy, accounting, counter, ckpt = parts(cfg, init_distributed(timeout_s=60))
        ckpt.resume({{"generator": counter}})
        ckpt.write_hook = lambda point, path: os._exit(7) if point == "meta" and path.name.endswith("2") else None
        for step in (1, 2):
            train_step(strategy, accounting, counter, step)
            ckpt.step_done(step, policy_version=step)
        ckpt.wait()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 7, proc.stderr[-2000:]
    assert (step_dir(tmp_path, 2) / ".metadata").is_file() and not (step_dir(tmp_path, 2) / "meta.json").exists()
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)


def test_a_resume_skips_an_interrupted_async_save(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=1, async_save=True)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    ckpt.resume({"generator": counter})
    train_step(strategy, accounting, counter, 1)
    ckpt.step_done(1, policy_version=1)
    ckpt.wait()
    ckpt.write_hook = lambda point, path: (_ for _ in ()).throw(RuntimeError("died")) if point == "meta" else None
    train_step(strategy, accounting, counter, 2)
    ckpt.step_done(2, policy_version=2)
    with pytest.raises(CheckpointSaveError, match="RuntimeError: died"):
        ckpt.wait()
    _, _, counter_b, ckpt_b = parts(cfg, dist)
    assert ckpt_b.resume({"generator": counter_b}).step == 1
    assert not step_dir(tmp_path, 2).exists()  # the interrupted save was removed at the start


def test_a_write_past_the_timeout_names_the_checkpoint_and_rank(tmp_path):
    writer = BackgroundWriter(rank=3, timeout_s=0.05)
    gate = threading.Event()
    writer.submit(tmp_path / "step_00000009", lambda: gate.wait(10))
    with pytest.raises(CheckpointSaveError) as info:
        writer.wait()
    assert str(info.value) == (
        f"checkpoint {tmp_path / 'step_00000009'}: the background write on rank 3 did not finish within "
        "checkpoint.save_timeout_s=0.05 s (a slow disk, or another rank stopped writing); the previous complete "
        "checkpoint stays the latest")
    gate.set()
    writer.timeout_s = 10
    writer.wait()  # the same write, now finished: no error
    assert not writer.in_flight


def test_staging_copies_and_reuses_host_buffers():
    stager = HostStager()
    live = {"w": torch.arange(6.0).reshape(2, 3), "opt": [{"step": torch.tensor(4.0), "lr": 0.1}], "name": "x"}
    first = stager.stage(live)
    live["w"].add_(100)  # the training thread changes the live state after staging
    live["opt"][0]["lr"] = 0.2
    assert torch.equal(first["w"], torch.arange(6.0).reshape(2, 3)) and first["opt"][0]["lr"] == 0.1
    assert stager.bytes_allocated == stager.bytes_staged == 6 * 4 + 4
    second = stager.stage(live)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # same buffer, no new host allocation
    assert stager.bytes_allocated == 0 and torch.equal(second["w"], live["w"])


def test_async_save_setting(model_dir, tmp_path):
    from streamrft.config.checkpoint import validate_checkpoint

    assert async_save_enabled(config(model_dir, tmp_path), "cuda") is True  # auto: on for FSDP2 on a GPU
    assert async_save_enabled(config(model_dir, tmp_path), "cpu") is False
    assert async_save_enabled(config(model_dir, tmp_path, async_save=True), "cpu") is True
    cfg = config(model_dir, tmp_path, async_save=True)
    import msgspec

    ds = msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, strategy="deepspeed"))
    assert async_save_enabled(msgspec.structs.replace(
        ds, checkpoint=msgspec.structs.replace(ds.checkpoint, async_save="auto")), "cuda") is False
    with pytest.raises(ConfigError, match="checkpoint.async_save=true needs train.strategy=fsdp2"):
        validate_checkpoint(ds)
    with pytest.raises(ConfigError, match=r"checkpoint.save_timeout_s=0 must be > 0 seconds"):
        validate_checkpoint(config(model_dir, tmp_path, save_timeout_s=0))


def test_a_signal_save_returns_only_once_its_checkpoint_is_complete(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=0, async_save=True)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    ckpt.resume({"generator": counter})
    ckpt.write_hook = lambda point, path: time.sleep(0.5) if point == "meta" else None
    train_step(strategy, accounting, counter, 1)
    assert ckpt.step_done(1, policy_version=1) is None
    assert ckpt.save_on_signal() == step_dir(tmp_path, 1)
    assert read_meta(step_dir(tmp_path, 1))["reason"] == "signal"  # complete when the call returns
    assert not ckpt._background.in_flight


def test_prewarmed_buffers_are_the_ones_the_first_save_copies_into():
    stager = HostStager()
    live = {"w": torch.ones(3, 4), "opt": [{"m": torch.zeros(5)}], "lr": 0.1}
    stager.prewarm(live)
    staged = stager.stage(live)
    assert stager.bytes_allocated == 0 and stager.bytes_staged == (12 + 5) * 4  # allocated ahead, only copied
    assert torch.equal(staged["w"], live["w"]) and staged["w"].data_ptr() != live["w"].data_ptr()


def test_the_checkpointer_prewarms_after_a_step_that_does_not_save(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=2, async_save=True)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    ckpt.resume({"generator": counter})
    train_step(strategy, accounting, counter, 1)
    assert ckpt.step_done(1, policy_version=1) is None and set(ckpt._stagers) == {""}
    train_step(strategy, accounting, counter, 2)
    ckpt.step_done(2, policy_version=2)
    assert ckpt._stagers[""].bytes_allocated == 0 and ckpt._stagers[""].bytes_staged > 0
    ckpt.wait()
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_deferred_save_is_complete_only_after_commit_and_an_uncommitted_one_is_left_incomplete(
        dist, model_dir, tmp_path, async_save):
    """The training loop saves with defer_complete and commits after the step's steps.jsonl line: a process
    killed in between must resume from the previous checkpoint (and log the step again), not skip the step."""
    cfg = config(model_dir, tmp_path, save_every=1, async_save=async_save)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    ckpt.resume({"generator": counter})
    train_step(strategy, accounting, counter, 1)
    ckpt.step_done(1, policy_version=1, defer_complete=True)
    time.sleep(0.5 if async_save else 0)  # the background write has every shard on disk by now, or soon
    assert latest_checkpoint(tmp_path) is None  # shards, but no meta.json before commit
    ckpt.commit()
    ckpt.wait()
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
    train_step(strategy, accounting, counter, 2)
    ckpt.step_done(2, policy_version=2, defer_complete=True)
    ckpt.wait()  # the step failed before its records: the save is left incomplete, and the wait does not hang
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
    assert not (step_dir(tmp_path, 2) / "meta.json").exists()
    _, _, counter_b, ckpt_b = parts(cfg, dist)
    assert ckpt_b.resume({"generator": counter_b}).step == 1
