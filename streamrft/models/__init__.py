"""Model builders and loaders: tiny local models for CPU demos (``tiny``); wrappers come later."""

from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy

__all__ = ["build_char_tokenizer", "build_tiny_qwen2", "load_policy"]
