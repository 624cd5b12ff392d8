"""Multimodal pipelines: shipped GPU configs validate; the CPU visual-count pipeline runs end to end (audio_qa: tests/integration/test_audio_qa_train.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrft.config import load_config, validate_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["geo3k", "audio_qa"])
def test_the_shipped_multimodal_gpu_configs_load_and_validate(name):
    cfg = load_config(ROOT / "pipelines" / name / ("config_gpu.yaml" if name == "audio_qa" else "config.yaml"))
    validate_config(cfg, check_paths=False)
    assert (cfg.data.image_field, cfg.data.audio_field) == (("image", "") if name == "geo3k" else ("", "audio"))


@pytest.mark.slow
def test_visual_count_grpo_runs_end_to_end_and_reports_accuracy(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", *a], cwd=ROOT, capture_output=True, text=True, timeout=120,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    prep = run("pipelines.visual_count.prepare", "--out", str(tmp_path), "--sft_steps", "5")
    assert prep.returncode == 0, prep.stderr[-2000:]
    train = run("pipelines.visual_count.train", "--model", str(tmp_path / "sft"), "--steps", "3", "--eval_size", "20")
    assert train.returncode == 0, train.stderr[-2000:]
    assert "held-out greedy accuracy before" in train.stdout
