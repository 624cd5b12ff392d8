"""Datasets of prompts (jsonl, parquet) and their deterministic, resumable order."""

from streamrft.data.prompts import DataError, PromptDataset, PromptRow
from streamrft.data.order import EpochOrder

__all__ = ["DataError", "PromptDataset", "PromptRow", "EpochOrder"]
