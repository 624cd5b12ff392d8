"""StreamRFT: streaming reinforcement fine-tuning for language and multimodal models."""

__version__ = "0.1.0"
