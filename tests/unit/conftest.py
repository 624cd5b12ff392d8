"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The learner tests' tiny Qwen2 (2 layers, hidden 32) with a character tokenizer, saved in Hugging Face format
    and loaded through the real loading code; one per test module. A module that needs another model defines its
    own ``model_dir``."""
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    d = str(tmp_path_factory.mktemp("tiny"))
    tok = build_char_tokenizer(d, "0123456789+-=abcdefghijklmnopq")
    return build_tiny_qwen2(d, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    """The engine tests' tiny Qwen2 policy (2 layers, hidden 32, vocabulary "0123456789+-= "), saved and loaded
    through the real loading code, in eval mode; one per test module."""
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy

    out = str(tmp_path_factory.mktemp("tiny"))
    tok = build_char_tokenizer(out, "0123456789+-= ")
    build_tiny_qwen2(out, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return load_policy(out)[0].eval()
