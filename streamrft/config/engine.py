from __future__ import annotations

from typing import Literal

from streamrft.config.base import Section


class EngineConfig(Section):
    type: Literal["hf", "vllm", "sglang"] = "hf"  # rollout engine
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32  # response length cap; hitting it gives finish_reason="length"
    stop_token_ids: list[int] = []  # extra stop tokens besides the tokenizer's EOS
    first_token_temperature: float = 0.0  # FIRE sampling: temperature of the first token; 0 = off
    max_batch_size: int = 256  # sequences decoded together by the hf engine
    address: str = ""  # remote vllm / sglang server URL; "" = in process
    sleep_level: int = 1  # 1 = free KV cache; 2 = also release weights (vllm / sglang)
