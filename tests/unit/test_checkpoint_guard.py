"""Issue 16 items 3 and 9 with a real FSDP2Strategy at world size 1: the resume guard (config saved with
each checkpoint, training-relevant differences refused with the diff), checkpoint.resume modes, a torn
steps.jsonl, a corrupt newest checkpoint, and a disk-full / file-size-limited save."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch

from streamrft.checkpoint import Checkpointer, CheckpointWriteError, check_resume, complete_checkpoints, step_dir
from streamrft.checkpoint.guard import CONFIG_FILE, config_diff
from streamrft.checkpoint.manager import reset_steps_log
from streamrft.config import Config, ConfigError
from streamrft.config.checkpoint import CheckpointConfig
from streamrft.config.model import ModelConfig
from streamrft.config.train import TrainConfig
from streamrft.learner.fsdp2 import FSDP2Strategy
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
from streamrft.runtime.accounting import Accounting

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    tok = build_char_tokenizer(d, "0123456789+-=abc")
    return build_tiny_qwen2(d, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=64)


def config(model_dir, out, max_steps=4, **checkpoint) -> Config:
    return Config(output_dir=str(out), seed=3, model=ModelConfig(path=str(model_dir)),
                  train=TrainConfig(max_steps=max_steps, lr=1e-2), checkpoint=CheckpointConfig(**checkpoint))


def replace(cfg: Config, section: str, **values) -> Config:
    return msgspec.structs.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section), **values)})


def saved_run(cfg, dist, steps=(1,)) -> dict[int, dict]:
    """Save a checkpoint after each of ``steps`` (weights moved in between); returns each step's weights."""
    strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=cfg.train.max_steps)
    ckpt = Checkpointer(cfg, dist, strategy, Accounting())
    assert ckpt.resume({}) is None
    saved = {}
    for step in steps:
        with torch.no_grad():
            for p in strategy.module.parameters():
                p.add_(0.01 * step)
        assert ckpt.step_done(step, policy_version=step) == step_dir(cfg.output_dir, step)
        saved[step] = weights(strategy)
    return saved


def weights(strategy):
    return {k: v.full_tensor().clone() for k, v in strategy.module.state_dict().items()}


# ---- item 3: the resume guard ---------------------------------------------------------------------------
def test_item3_the_resolved_config_is_saved_with_each_checkpoint(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=1)
    saved_run(cfg, dist)
    saved = json.loads((step_dir(tmp_path, 1) / CONFIG_FILE).read_text())
    assert saved == json.loads(json.dumps(msgspec.to_builtins(cfg)))
    assert saved["algorithm"]["policy_loss"] == "ppo_clip" and saved["train"]["lr"] == 1e-2


def test_item3_a_resume_with_other_training_settings_is_refused_with_the_diff(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=1)
    saved_run(cfg, dist)
    other = replace(replace(cfg, "algorithm", policy_loss="gspo", advantage_estimator="rloo"), "train", lr=3e-4)
    with pytest.raises(ConfigError) as info:
        check_resume(other, world_size=1)  # before any model is loaded
    message = str(info.value)
    assert message.startswith(f"{step_dir(tmp_path, 1)} was saved by a run with other training settings")
    assert ('Differences (checkpoint -> this run):\n'
            '  algorithm.advantage_estimator: "group_norm" -> "rloo"\n'
            '  algorithm.policy_loss: "ppo_clip" -> "gspo"\n'
            '  train.lr: 0.01 -> 0.0003\n') in message
    strategy = FSDP2Strategy(other.model, other.train, dist, total_steps=4)
    with pytest.raises(ConfigError, match="was saved by a run with other training settings"):
        Checkpointer(other, dist, strategy, Accounting()).resume({})  # the loader refuses it too


def test_item3_max_steps_eval_logging_metrics_sinks_checkpoint_and_output_dir_may_change(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=1)
    saved_run(cfg, dist)
    later = replace(cfg, "train", max_steps=40, eval_every=5, log_every=10)
    later = replace(replace(later, "data", eval_path="held.jsonl", eval_size=16), "metrics", port=9400, tensorboard=True)
    later = replace(replace(later, "sinks", jsonl="traj"), "checkpoint", save_every=7, keep=4, resume="required")
    assert check_resume(later, world_size=1) == step_dir(tmp_path, 1)
    moved = tmp_path.parent / (tmp_path.name + "_moved")
    tmp_path.rename(moved)
    assert check_resume(msgspec.structs.replace(later, output_dir=str(moved)), world_size=1) == step_dir(moved, 1)


def test_item3_config_diff_ignores_keys_of_other_versions_and_tuple_list_forms():
    old = {"seed": 1, "train": {"adam_betas": [0.9, 0.99], "gone": 1}, "output_dir": "a"}
    new = {"seed": 1, "train": {"adam_betas": (0.9, 0.99), "added": 2}, "output_dir": "b"}
    assert config_diff(old, new) == []
    assert config_diff(old, {**new, "seed": 2}) == ["seed: 1 -> 2"]


def test_item3_resume_modes(dist, model_dir, tmp_path):
    empty = tmp_path / "empty"
    with pytest.raises(ConfigError) as info:
        check_resume(config(model_dir, empty, resume="required"), world_size=1)
    assert str(info.value) == (f"checkpoint.resume=required but {empty / 'checkpoints'} holds no complete checkpoint; "
                               "check output_dir, or set checkpoint.resume=auto to start fresh")
    assert check_resume(config(model_dir, empty, resume="never"), world_size=1) is None
    assert check_resume(config(model_dir, empty, resume=True), world_size=1) is None
    cfg = config(model_dir, tmp_path / "run", save_every=1)
    saved_run(cfg, dist)
    for never in ("never", False):  # the old boolean false means never
        with pytest.raises(ConfigError) as info:
            check_resume(replace(cfg, "checkpoint", resume=never), world_size=1)
        assert str(info.value) == (f"{step_dir(cfg.output_dir, 1)} holds a checkpoint of an earlier run and "
                                   "checkpoint.resume=never; pass a new output_dir to start fresh, or set "
                                   "checkpoint.resume=auto to continue that run")
    for auto in ("auto", True, "required"):
        assert check_resume(replace(cfg, "checkpoint", resume=auto), world_size=1) == step_dir(cfg.output_dir, 1)


def test_item3_the_dry_run_reports_the_resume_and_refuses_a_changed_run(dist, model_dir, tmp_path, capsys):
    from streamrft.cli import main
    from streamrft.config import load_config

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "reference": "2"}) + "\n")
    file = tmp_path / "c.yaml"
    file.write_text(json.dumps({"seed": 3, "output_dir": str(tmp_path / "run"), "model": {"path": str(model_dir)},
                                "data": {"train_path": str(data)}, "train": {"max_steps": 4},
                                "checkpoint": {"save_every": 1}, "reward": {"sources": [{"name": "r", "fn": "arith"}]}}))
    saved_run(load_config(file), dist)
    assert main(["train", str(file), "--dry-run", "train.max_steps=8"]) == 0
    assert f"it would resume from {step_dir(tmp_path / 'run', 1)}" in capsys.readouterr().out
    assert main(["train", str(file), "--dry-run", "algorithm.policy_loss=gspo"]) == 2
    assert 'Differences (checkpoint -> this run):\n  algorithm.policy_loss: "ppo_clip" -> "gspo"\n' in capsys.readouterr().err


# ---- item 9: torn log, corrupt checkpoint, full disk ------------------------------------------------------
def test_item9_a_torn_last_line_of_steps_jsonl_is_cut_off_with_a_message(tmp_path, capsys):
    log = tmp_path / "steps.jsonl"
    log.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    reset_steps_log(log, start_step=2)
    assert log.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n'
    assert capsys.readouterr().out == (f"streamrft: {log}: the last line (line 3) is torn ('{{\"step\": 3, \"lo'); "
                                       "cut it off\n")
    log.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(ValueError, match=rf"^{log}, line 2: not a step record \(JSONDecodeError: "):
        reset_steps_log(log, start_step=2)


def test_item9_a_corrupt_newest_checkpoint_falls_back_to_the_newest_that_loads(dist, model_dir, tmp_path, capsys):
    cfg = config(model_dir, tmp_path, save_every=1, keep=3)
    saved = saved_run(cfg, dist, steps=(1, 2, 3))
    capsys.readouterr()
    # step 3: meta.json torn; step 2: a shard truncated (its small files read, the load fails)
    (step_dir(tmp_path, 3) / "meta.json").write_text('{"format": 1, "st')
    shard = next(step_dir(tmp_path, 2).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    fresh = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=4)
    resumed = Checkpointer(cfg, dist, fresh, Accounting()).resume({})
    out = capsys.readouterr().out
    assert resumed.step == 1 and resumed.path == step_dir(tmp_path, 1)
    assert f"streamrft: skipped checkpoint {step_dir(tmp_path, 3)}: {step_dir(tmp_path, 3) / 'meta.json'}: cannot read " \
           "checkpoint metadata: " in out
    assert f"streamrft: skipped checkpoint {step_dir(tmp_path, 2)}: rank 0: EOFError\n" in out  # the shard ends early
    assert f"streamrft: resumed from {step_dir(tmp_path, 1)} (step 1) instead of the newer checkpoint(s) above" in out
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1]  # the others renamed aside, kept for inspection
    aside = tmp_path / "checkpoints" / "unloadable_step_00000002"
    assert aside.is_dir() and (aside / "UNLOADABLE.txt").read_text() == "rank 0: EOFError\n"
    loaded = weights(fresh)
    assert all(torch.equal(loaded[k], saved[1][k]) for k in loaded)  # step 1's weights, not a mix with step 2's
    assert not all(torch.equal(loaded[k], saved[2][k]) for k in loaded)


def test_item9_a_full_disk_during_a_save_says_enospc_and_the_path(dist, model_dir, tmp_path, monkeypatch):
    import streamrft.checkpoint.manager as manager

    cfg = config(model_dir, tmp_path, save_every=1)
    strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=4)
    ckpt = Checkpointer(cfg, dist, strategy, Accounting())
    ckpt.resume({})

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(manager, "write_json_atomic", full)
    with pytest.raises(CheckpointWriteError) as info:
        ckpt.step_done(1, policy_version=1)
    assert info.value.errno == errno.ENOSPC
    assert info.value.strerror == (
        f"saving checkpoint {step_dir(tmp_path, 1)} failed: ENOSPC, no space left on the device (the save raised "
        f"OSError: [Errno 28] No space left on device: '{step_dir(tmp_path, 1) / 'rank_00000.json'}'); free space "
        "or raise the limit, then resume: the incomplete folder is removed at the next start")


@pytest.mark.slow
def test_item9_a_file_size_limit_during_a_save_says_efbig(model_dir, tmp_path):
    """`ulimit -f` in a real second process: the DCP shard hits the limit (torch reports it wrapped)."""
    script = textwrap.dedent(f"""
        import resource
        from streamrft.checkpoint import Checkpointer
        from streamrft.config import Config
        from streamrft.config.model import ModelConfig
        from streamrft.learner.fsdp2 import FSDP2Strategy
        from streamrft.runtime.accounting import Accounting
        from streamrft.runtime.distributed import init_distributed
        cfg = Config(output_dir={str(tmp_path)!r}, model=ModelConfig(path={str(model_dir)!r}))
        dist = init_distributed(timeout_s=60)
        ckpt = Checkpointer(cfg, dist, FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=1), Accounting())
        ckpt.resume({{}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (60000, resource.RLIM_INFINITY))
        ckpt.step_done(cfg.train.max_steps, policy_version=1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"[rank0]: streamrft.checkpoint.manager.CheckpointWriteError: [Errno 27] saving checkpoint "
                           f"{step_dir(tmp_path, 100)} failed: EFBIG, file too large (a file-size limit, e.g. "
                           "`ulimit -f`) (the save raised CheckpointException: "), last
