"""TensorBoard / W&B loggers: scalars read back from their files; no credential ever written."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from streamrft.metrics.loggers import REDACTED, TensorBoardLogger, WandbLogger, build_loggers, redact_secrets

SECRET = "sk-test-0123456789abcdef"


def read_tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def all_bytes_under(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in directory.rglob("*") if p.is_file())


def test_redact_secrets_replaces_credential_keys_and_env_secret_values_but_keeps_token_counts(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    config = {
        "train": {"max_new_tokens": 64, "lr": 1e-3},
        "wandb_api_key": "abc",
        "reward": {"remote": {"auth_token": "xyz", "url": f"http://u:{SECRET}@host"}},
        "hf_token": "hf_abc",
        "list": [{"password": "p"}],
    }
    clean = redact_secrets(config)
    assert clean["train"] == {"max_new_tokens": 64, "lr": 1e-3}
    assert clean["wandb_api_key"] == REDACTED
    assert clean["reward"]["remote"] == {"auth_token": REDACTED, "url": REDACTED}
    assert clean["hf_token"] == REDACTED
    assert clean["list"] == [{"password": REDACTED}]
    assert config["wandb_api_key"] == "abc"  # the caller's dict is untouched


def test_tensorboard_logger_writes_scalars_under_observe_step_names_and_no_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    logger = TensorBoardLogger(tmp_path / "tb", config={"seed": 1, "wandb_api_key": SECRET, "note": SECRET})
    logger.log(1, {"loss": 0.5, "reward/correct": 0.25})
    logger.log(2, {"loss": 0.125})
    logger.close()
    scalars = read_tb_scalars(tmp_path / "tb")
    assert scalars["loss"] == [(1, 0.5), (2, 0.125)]
    assert scalars["reward/correct"] == [(1, 0.25)]
    assert SECRET.encode() not in all_bytes_under(tmp_path)


def test_build_loggers_gives_rank_zero_its_loggers_and_other_ranks_none(tmp_path):
    cfg = SimpleNamespace(tensorboard=True, wandb=False, wandb_project="p", wandb_mode="offline")
    assert build_loggers(cfg, tmp_path, rank=1, config_dict={}) == []
    loggers = build_loggers(cfg, tmp_path, rank=0, config_dict={})
    assert [type(x) for x in loggers] == [TensorBoardLogger]
    loggers[0].close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install wandb)")
def test_wandb_offline_run_records_scalars_and_a_redacted_config_without_the_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger("streamrft-test", "offline", tmp_path, {"seed": 3, "wandb_api_key": SECRET, "x": SECRET})
    logger.log(1, {"loss": 0.5})
    logger.close()
    # wandb's service process may still be writing the run file after finish() returns: poll for it.
    deadline = time.monotonic() + 20
    run_bytes = b""
    while time.monotonic() < deadline and not (b"loss" in run_bytes and REDACTED.encode() in run_bytes):
        time.sleep(0.2)
        run_bytes = b"".join(p.read_bytes() for p in tmp_path.rglob("run-*.wandb"))
    assert b"loss" in run_bytes and REDACTED.encode() in run_bytes, f"no complete offline run under {tmp_path}"
    assert SECRET.encode() not in all_bytes_under(tmp_path)
