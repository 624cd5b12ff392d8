"""A vision-language policy trained through the real runtime (Generator -> engine with images -> learner
recompute with images -> held-out evaluation with images), with one corrupt-image row in the data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from streamrft.config import load_config

# in pytest's own process, one thread: `make test` runs it in the unit group (tests/conftest.py)
pytestmark = pytest.mark.one_process
REPO = Path(__file__).resolve().parents[2]
N_SAMPLES, PROMPTS, STEPS = 4, 4, 3


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    from pipelines.visual_count.prepare import prepare

    out = tmp_path_factory.mktemp("visual_count")
    prepare(str(out), sft_steps=15, batch_size=16, n_train=PROMPTS * STEPS, n_eval=8)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    Path(rows[1]["image"]).write_bytes(b"this is not a png")  # row 1: a corrupt image
    return out


def _config(vl_dir: Path, output_dir: Path, *extra: str):
    return load_config(str(REPO / "pipelines" / "visual_count" / "config.yaml"), [
        f"model.path={vl_dir / 'sft'}",
        f"data.train_path={vl_dir / 'train.jsonl'}",
        f"data.eval_path={vl_dir / 'eval.jsonl'}",
        "data.shuffle=false",
        f"output_dir={output_dir}",
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.n_samples_per_prompt={N_SAMPLES}",
        "rollout.stage_timeout_s=60",
        f"train.max_steps={STEPS}",
        *extra,
    ])


@pytest.mark.slow
def test_vl_policy_trains_through_the_runtime_with_images_and_fails_the_corrupt_image_row(vl_dir, tmp_path, caplog):
    from streamrft.compose import train

    summary = train(_config(vl_dir, tmp_path / "rl"))
    steps = [json.loads(line) for line in (tmp_path / "rl" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == STEPS
    for s in steps:
        assert all(math.isfinite(v) for v in s.values() if isinstance(v, float)), s
    # Step 1 is on-policy: the learner's recompute with the image equals the engine's behaviour log-probs.
    # (Dropping the image would shift every log-prob and move this weight far from 1.)
    assert abs(steps[0]["tis_weight_mean"] - 1.0) < 1e-3, steps[0]
    assert abs(steps[0]["ratio_mean"] - 1.0) < 1e-3, steps[0]
    # Accounting: one row of 12 has a corrupt image -> its samples fail, the rest train.
    assert summary["samples_admitted"] == PROMPTS * STEPS * N_SAMPLES
    assert summary["samples_failed/media_error"] == N_SAMPLES
    assert summary["samples_trained"] == (PROMPTS * STEPS - 1) * N_SAMPLES
    assert "row 1 field 'image'" in caplog.text and "cannot decode" in caplog.text
    # Held-out evaluation ran with images on every row, before and after.
    assert summary["heldout_n_before"] == summary["heldout_n_after"] == 8
    assert summary["heldout_media_errors_before"] == 0


@pytest.mark.slow
def test_a_corrupt_image_row_stops_the_run_under_fail_fast_naming_file_row_and_field(vl_dir, tmp_path):
    from streamrft.compose import train

    with pytest.raises(Exception, match=r"train\.jsonl row 1 field 'image'.*cannot decode"):
        train(_config(vl_dir, tmp_path / "rl", "fail_fast=true", "train.max_steps=1"))
