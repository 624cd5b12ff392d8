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
