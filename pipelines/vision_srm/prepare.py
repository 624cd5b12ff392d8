"""Prepare (and optionally train) the media reward-model demos: tiny Qwen2-VL / Qwen2-Audio backbones and
synthetic preference rows (task.py), for ``streamrft train-rm pipelines/vision_srm/<config>.yaml``.

    python pipelines/vision_srm/prepare.py runs/vision_srm [--seed 0]
    streamrft train-rm pipelines/vision_srm/config.yaml         # vision SRM (dominant colour)
    streamrft train-rm pipelines/vision_srm/audio.yaml          # audio SRM (pitch class)
    streamrft train-rm pipelines/vision_srm/grm.yaml            # image GRM (pointwise verdicts)
    streamrft eval-rm pipelines/vision_srm/config.yaml

Writes OUT/vl, OUT/vl_judge and OUT/al (backbones), OUT/{image,audio}_{train,eval}.jsonl (pairs) and
OUT/judge_{train,eval}.jsonl (judgments), with the media files beside them. Idempotent.

:func:`train_vision_srm` is the reusable part: it builds a tiny Qwen2-VL over an alphabet and trains a scalar
RM on any preference files whose rows carry an image or a video field (pipelines/video_rm_rl calls it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipelines.vision_srm.task import ALPHABET, write_image_judgments, write_media_pairs  # noqa: E402

N_TRAIN, N_EVAL = 256, 200
# the tiny backbones: 2 text layers of width 32 (the vision tower / audio encoder as built by the helpers).
# The judge gets 3: with 2 (width 32, lr 3e-3, 300 steps, or width 64, lr 1e-3, 150 steps) the verdict stayed at
# chance (0.48-0.52) while the format was learnt; its verdict sits 5 tokens after the response, which it must
# find among the prompt's characters, where the SRM reads the token right after the response.
BACKBONE = {"num_layers": 2, "hidden_size": 32}
JUDGE_BACKBONE = {"num_layers": 3, "hidden_size": 32}


def build_backbone(out_dir: str, kind: str, alphabet: str = ALPHABET, seed: int = 0, **kwargs) -> str:
    """A random tiny Qwen2-VL (``kind="vl"``) or Qwen2-Audio (``"audio"``) in ``out_dir`` (kept if present)."""
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    size = {**BACKBONE, **kwargs}
    if kind == "vl":
        from streamrft.models.vl import build_tiny_qwen2_vl

        return build_tiny_qwen2_vl(out_dir, alphabet, seed=seed, **size)
    from streamrft.models.audio import build_tiny_qwen2_audio

    return build_tiny_qwen2_audio(out_dir, alphabet, seed=seed, **size)


def train_vision_srm(out_dir: str, train_path: str, eval_path: str, alphabet: str, field: str = "image",
                     video: bool = False, steps: int = 60, lr: float = 3e-3, batch_size: int = 16, seed: int = 0,
                     max_video_frames: int = 16, video_fps: float = 0.0, backbone: dict | None = None) -> dict:
    """Build a tiny Qwen2-VL over ``alphabet`` in OUT/backbone and train a scalar RM (Bradley-Terry) on the
    preference rows of ``train_path`` whose media is in row field ``field`` (an image, or with ``video`` a video
    file / frame list); the RM is saved in OUT/rm. Returns train-rm's summary (``eval_pairwise_accuracy`` on
    ``eval_path``). The RM config is written to OUT/rm.yaml, so ``streamrft eval-rm OUT/rm.yaml`` repeats the
    evaluation."""
    from streamrft.rm.config import load_rm_config, validate_rm_config
    from streamrft.rm.train import train_srm

    out = Path(out_dir)
    path = build_backbone(str(out / "backbone"), "vl", alphabet, seed, **(backbone or {}))
    media_key = "video_field" if video else "image_field"
    config = {"kind": "srm", "seed": seed, "output_dir": str(out / "rm"), "model": {"path": path},
              "data": {"train_path": train_path, "eval_path": eval_path, media_key: field,
                       "max_video_frames": max_video_frames, "video_fps": video_fps},
              "train": {"steps": steps, "batch_size": batch_size, "lr": lr, "loss": "bradley_terry",
                        "log_every": max(1, steps // 5)}}
    (out / "rm.yaml").write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    cfg = load_rm_config(out / "rm.yaml")
    validate_rm_config(cfg)
    return train_srm(cfg)


def prepare(out_dir: str, seed: int = 0) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_backbone(str(out / "vl"), "vl", seed=seed)
    build_backbone(str(out / "vl_judge"), "vl", seed=seed, **JUDGE_BACKBONE)
    build_backbone(str(out / "al"), "audio", seed=seed)
    for kind in ("image", "audio"):
        if not (out / f"{kind}_eval.jsonl").is_file():
            write_media_pairs(out, f"{kind}_train", N_TRAIN, seed, kind)
            write_media_pairs(out, f"{kind}_eval", N_EVAL, seed + 1, kind)
    if not (out / "judge_eval.jsonl").is_file():
        write_image_judgments(out, "judge_train", N_TRAIN, seed, pointwise=True)
        write_image_judgments(out, "judge_eval", N_EVAL, seed + 1, pointwise=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prepare(args.out_dir, args.seed)
    print(f"prepared {args.out_dir}")


if __name__ == "__main__":
    main()
