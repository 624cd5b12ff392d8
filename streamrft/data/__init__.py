"""Datasets of prompts (jsonl, parquet) and their deterministic, resumable order."""

from streamrft.data.errors import DataError
from streamrft.data.prompts import PromptDataset, PromptRow
from streamrft.data.rows import read_rows
from streamrft.data.order import EpochOrder

__all__ = ["DataError", "PromptDataset", "PromptRow", "EpochOrder", "read_rows"]
