from __future__ import annotations

from typing import Literal

from streamrft.config.base import Section


class ModelConfig(Section):
    path: str = ""  # Hugging Face model directory (config.json + weights + tokenizer)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter / compute dtype
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gradient_checkpointing: bool = False  # recompute activations in backward
    freeze_prefix: list[str] = []  # parameter-name prefixes kept frozen (e.g. a vision tower)
    reference_path: str = ""  # frozen reference model for KL; "" = same as path
