from __future__ import annotations

from typing import Literal

from streamrft.config.base import Section


class DataConfig(Section):
    train_path: str = ""  # jsonl or parquet of prompts (or a `datasets` save_to_disk dir / hub id[:split] with the datasets extra)
    eval_path: str = ""  # held-out jsonl or parquet; "" = no evaluation
    format: Literal["auto", "flat", "verl", "trl"] = "auto"  # field presets (streamrft/data/formats.py); auto = from the first row
    prompt_field: str = "prompt"  # text or chat messages [{role, content}]; a dotted path reads nested fields
    reference_field: str = "reference"  # dotted path allowed, e.g. reward_model.ground_truth
    label_field: str = "label"  # optional per-row task label; missing = "default"
    chat_template: str = "auto"  # message prompts: auto = the tokenizer's template | none = refuse them | PATH = a Jinja file
    system_prompt: str = ""  # prepended to message prompts as a system message (unless the row starts with one)
    shuffle: bool = True  # reshuffle each epoch with the run seed
    max_prompt_tokens: int = 512  # longer prompts are a data error naming file and row
    eval_size: int = 0  # evaluate on the first N held-out rows; 0 = all
    image_field: str = ""  # row field with image(s): path, bytes, base64 data URI or list of them; "" = none
    video_field: str = ""  # row field with a video: list of frame images or a video file (mp4/webm ..., the video extra: PyAV); "" = none
    audio_field: str = ""  # row field with audio clip(s): wav/flac path(s), resampled to the processor's rate; "" = none
    max_video_frames: int = 16  # videos keep this many evenly spaced frames; 0 = all
    video_fps: float = 0.0  # video files are sampled at this many frames per second (by timestamp) before max_video_frames; 0 = every frame
