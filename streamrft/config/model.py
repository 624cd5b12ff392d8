from __future__ import annotations

from typing import Literal

from streamrft.config.base import Section


class ModelConfig(Section):
    path: str = ""  # Hugging Face model directory (config.json + weights + tokenizer), or a hub id in the local HF cache
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter / compute dtype
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gradient_checkpointing: bool = False  # recompute activations in backward
    freeze_prefix: list[str] = []  # parameter-name prefixes kept frozen (e.g. a vision tower)
    reference_path: str = ""  # frozen reference model for KL (directory or cached hub id); "" = same as path
    lora_rank: int = 0  # LoRA rank r (peft) on model.lora_target_modules; 0 = full fine-tuning
    lora_alpha: float = 16.0  # LoRA scale numerator: adapter output scaled by lora_alpha / lora_rank
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # module-name suffixes LoRA wraps
    critic_path: str = ""  # value model (GAE critic) init: a HF causal-LM dir or cached hub id; "" = no critic
