"""pipelines/video_rm_rl: the GPU configs (Qwen2-VL-2B policy, a video RM) validate with `--dry-run` once their
model paths point at a Qwen2-VL directory and a trained media RM (tiny stand-ins built here), and the
dry-run still refuses what a real run would refuse."""

from pathlib import Path

import pytest

pytest.importorskip("av")

from streamrft.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "pipelines" / "video_rm_rl"


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """(tiny Qwen2-VL dir, tiny untrained video SRM dir, RL rows with mp4 files, preference rows)."""
    from pipelines.video_rm_rl.task import ALPHABET, write_split
    from streamrft.models.vl import build_tiny_qwen2_vl
    from streamrft.rm.config import media_fields
    from streamrft.rm.model import ScalarRewardModel

    d = tmp_path_factory.mktemp("video_rm_rl")
    vl = build_tiny_qwen2_vl(str(d / "vl"), ALPHABET, image_size=16)
    media = media_fields({"image_field": "", "video_field": "video", "audio_field": "", "max_video_frames": 16,
                          "video_fps": 2.0})
    ScalarRewardModel.from_backbone(vl, media=media).save_pretrained(d / "rm")
    return vl, str(d / "rm"), write_split(str(d), "rows", 2, seed=0), write_split(str(d), "pairs", 2, seed=1, pairs=True)


def test_the_gpu_rl_config_validates_with_dry_run(stand_ins, tmp_path, monkeypatch, capsys):
    vl, rm, rows, _ = stand_ins
    text = (HERE / "config_gpu.yaml").read_text()
    assert "path: Qwen/Qwen2-VL-2B-Instruct" in text and "model_path: runs/video_rm_rl_gpu/rm" in text
    cfg = tmp_path / "config_gpu.yaml"
    cfg.write_text(text.replace("path: Qwen/Qwen2-VL-2B-Instruct", f"path: {vl}")
                   .replace("model_path: runs/video_rm_rl_gpu/rm", f"model_path: {rm}"))
    monkeypatch.chdir(REPO)  # the custom rule metric's fn path is relative to the repository
    args = ["train", str(cfg), "--dry-run", f"data.train_path={rows}", f"data.eval_path={rows}",
            f"output_dir={tmp_path / 'rl'}"]
    assert main(args) == 0, capsys.readouterr().err
    assert "is valid" in capsys.readouterr().out
    assert main([*args, "data.video_fps=-1"]) == 2
    assert "data.video_fps=-1.0 must be >= 0" in capsys.readouterr().err


def test_the_gpu_rm_config_validates_with_dry_run(stand_ins, capsys):
    vl, _, _, pairs = stand_ins
    assert main(["train-rm", str(HERE / "rm_gpu.yaml"), f"model.path={vl}", f"data.train_path={pairs}",
                 f"data.eval_path={pairs}", "--dry-run"]) == 0, capsys.readouterr().err
    assert "is valid" in capsys.readouterr().out
