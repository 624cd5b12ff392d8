"""Audio-language policies (Qwen2-Audio): a tiny local model + processor, and model inputs for prompts
with audio clips.

The tiny model is ``Qwen2AudioForConditionalGeneration`` built from a config (no download): a 1-layer
Whisper-style encoder over 16 mel bins at 16 kHz (hop 160 = 100 frames/s, 1 s windows, so
``max_source_positions`` = 50) and a 1-2 layer Qwen2 text model over the character tokenizer plus the
Qwen2-Audio special tokens. The processor is the stock ``Qwen2AudioProcessor`` (WhisperFeatureExtractor +
tokenizer), saved and reloaded with ``AutoProcessor``. A clip of n samples becomes
((f - 1) // 2 + 1 - 2) // 2 + 1 placeholder tokens, f = its unpadded frame count.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor, WhisperFeatureExtractor

from streamrft.models.tiny import build_char_tokenizer

AUDIO_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
AUDIO_BLOCK = "<|audio_bos|><|AUDIO|><|audio_eos|>"


def build_tiny_qwen2_audio(
    out_dir: str,
    alphabet: str,
    hidden_size: int = 32,
    num_layers: int = 1,
    num_heads: int = 2,
    audio_dim: int = 32,
    sampling_rate: int = 16000,
    chunk_seconds: int = 1,
    seed: int = 0,
) -> str:
    """Build and save a random tiny Qwen2-Audio, its tokenizer and processor to ``out_dir``; returns it."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    tokenizer = build_char_tokenizer(out_dir, alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": AUDIO_SPECIAL_TOKENS})
    hop = sampling_rate // 100
    n_frames = chunk_seconds * sampling_rate // hop
    feature_extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=sampling_rate, hop_length=hop, padding_value=0.0,
                                                chunk_length=chunk_seconds, n_fft=400)
    config = Qwen2AudioConfig(
        audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=2 * audio_dim,
                          d_model=audio_dim, max_source_positions=n_frames // 2),
        text_config=dict(
            model_type="qwen2", vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=1,
            max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
        ),
        audio_token_id=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    Qwen2AudioProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template="").save_pretrained(out_dir)
    return out_dir


def audio_inputs(processor, prompt: str, audios: list[np.ndarray]) -> dict:
    """Model inputs of one prompt: input_ids (1, L), attention_mask, and input_features (A, mel, frames) /
    feature_attention_mask (A, frames) when there are clips (already at the processor's sampling rate).

    A prompt without ``<|AUDIO|>`` placeholders gets one audio block per clip prepended.
    """
    if audios and processor.audio_token not in prompt:
        prompt = AUDIO_BLOCK * len(audios) + prompt
    n = prompt.count(processor.audio_token)
    if n != len(audios):
        raise ValueError(f"prompt has {n} audio placeholders but the row has {len(audios)} audio clips; make them match")
    limit = processor.feature_extractor.n_samples
    for i, a in enumerate(audios):
        if len(a) > limit:
            raise ValueError(f"audio clip {i} has {len(a)} samples, more than the feature extractor's window of "
                             f"{limit} ({processor.feature_extractor.chunk_length} s); trim the clip")
    out = processor(text=[prompt], audio=audios or None, return_tensors="pt",
                    sampling_rate=processor.feature_extractor.sampling_rate)
    return {k: v for k, v in out.items() if k != "num_audio_tokens"}


def is_audio_model(model: torch.nn.Module) -> bool:
    from streamrft.models.multimodal import model_kind  # the one definition (it needs no audio import)

    return model_kind(model) == "audio"
