from __future__ import annotations

from streamrft.config.base import Section


class DataConfig(Section):
    train_path: str = ""  # jsonl or parquet of prompts
    eval_path: str = ""  # held-out jsonl or parquet; "" = no evaluation
    prompt_field: str = "prompt"
    reference_field: str = "reference"
    label_field: str = "label"  # optional per-row task label; missing = "default"
    shuffle: bool = True  # reshuffle each epoch with the run seed
    max_prompt_tokens: int = 512  # longer prompts are a data error naming file and row
    eval_size: int = 0  # evaluate on the first N held-out rows; 0 = all
    image_field: str = ""  # row field with image(s): path, bytes, base64 data URI or list of them; "" = none
    video_field: str = ""  # row field with a video: list of frame images or a video file (PyAV/torchcodec); "" = none
    audio_field: str = ""  # row field with audio clip(s): wav/flac path(s), resampled to the processor's rate; "" = none
    max_video_frames: int = 16  # videos keep this many evenly spaced frames; 0 = all
