"""Issue 16 item 13: what a new user trips on at the command line (config values, help, pipes, eval limits,
error texts). Real `streamrft` processes where the behaviour is a process's (exit code, pipe, stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrft.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def test_item13_quoted_numbers_stay_text_in_yaml_and_overrides_unquoted_numbers_keep_their_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('output_dir: "2024"\ntrain:\n  lr: 1e-3\n  max_steps: 12\n')
    cfg = load_config(path)
    assert (cfg.output_dir, cfg.train.lr, cfg.train.max_steps) == ("2024", 0.001, 12)
    cfg = load_config(None, ['output_dir="2024"', "train.lr=2e-4", "train.max_steps=7", "seed=3"])
    assert (cfg.output_dir, cfg.train.lr, cfg.train.max_steps, cfg.seed) == ("2024", 2e-4, 7, 3)
    assert load_config(None, ["output_dir='1e-3'"]).output_dir == "1e-3"
    with pytest.raises(ConfigError, match="Expected `str`, got `int` - at `output_dir`"):
        load_config(None, ["output_dir=2024"])  # unquoted: a number, as YAML says
    with pytest.raises(ConfigError, match="Expected `int`, got `str` - at `train.max_steps`"):
        load_config(None, ['train.max_steps="7"'])
