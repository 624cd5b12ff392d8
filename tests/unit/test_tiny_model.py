import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy

torch.set_num_threads(1)
ALPHABET = "0123456789+-= "


def test_char_tokenizer_maps_each_character_to_one_id_and_round_trips_text_with_spaces(tmp_path):
    tok = build_char_tokenizer(str(tmp_path), ALPHABET)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(tok) == 3 + len(ALPHABET)
    text = " 12 + 3 =-4  "
    ids = tok(text)["input_ids"]
    assert ids == [3 + ALPHABET.index(c) for c in text]
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert reloaded(text)["input_ids"] == ids
    assert reloaded.decode(ids) == text
    assert reloaded.decode(ids + [1, 0], skip_special_tokens=True) == text
    assert reloaded.padding_side == "left"


def test_a_model_directory_reloads_the_same_tokenizer_and_model(tmp_path):
    out = str(tmp_path)
    tok = build_char_tokenizer(out, ALPHABET)
    assert build_tiny_qwen2(out, tok, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, seed=3) == out
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (32, 1, len(tok))
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    # with a Qwen2 config.json next to it, AutoTokenizer builds a Qwen2Tokenizer: same ids, same text
    reloaded = AutoTokenizer.from_pretrained(out)
    text = "7 + 85= 92 "
    assert reloaded(text)["input_ids"] == tok(text)["input_ids"]
    assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 1)
    model, tok2 = load_policy(out)
    auto = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([tok2(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, auto(ids).logits)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def test_the_same_seed_builds_the_same_weights_and_another_seed_differs(tmp_path):
    tok = build_char_tokenizer(str(tmp_path / "t"), ALPHABET)
    sizes = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64)
    a, _ = load_policy(build_tiny_qwen2(str(tmp_path / "a"), tok, seed=1, **sizes))
    b, _ = load_policy(build_tiny_qwen2(str(tmp_path / "b"), tok, seed=1, **sizes))
    c, _ = load_policy(build_tiny_qwen2(str(tmp_path / "c"), tok, seed=2, **sizes))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[name], b.state_dict()[name])
    assert not torch.equal(a.state_dict()[name], c.state_dict()[name])


def test_load_policy_names_the_path_when_config_or_weights_are_missing(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*no config.json"):
        load_policy(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"{tmp_path}.*no weights"):
        load_policy(str(tmp_path))


def test_bad_alphabets_and_shapes_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="alphabet is empty"):
        build_char_tokenizer(str(tmp_path), "")
    with pytest.raises(ValueError, match="non-ASCII"):
        build_char_tokenizer(str(tmp_path), "12é")
    tok = build_char_tokenizer(str(tmp_path), ALPHABET)
    with pytest.raises(ValueError, match="num_heads=5"):
        build_tiny_qwen2(str(tmp_path), tok, hidden_size=32, num_heads=5)
