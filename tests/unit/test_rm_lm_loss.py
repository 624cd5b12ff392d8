"""The SRM's auxiliary LM loss on the chosen answer, against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from streamrft.config.base import ConfigError
from streamrft.rm.config import load_rm_config, validate_rm_config
from streamrft.rm.train import chosen_lm_loss


def test_chosen_lm_loss_averages_the_nll_of_response_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3, 4], [1, 3, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    prompt_len = torch.tensor([2, 1])
    # Row 0 predicts positions 2 and 3; row 1 predicts positions 1 and 2 (position 3 is padding).
    terms = []
    for b, positions in ((0, (2, 3)), (1, (1, 2))):
        for t in positions:
            logp = logits[b, t - 1] - torch.logsumexp(logits[b, t - 1], 0)
            terms.append(-logp[ids[b, t]].item())
    assert chosen_lm_loss(logits, ids, mask, prompt_len).item() == pytest.approx(sum(terms) / len(terms), abs=1e-12)
    assert math.isfinite(chosen_lm_loss(logits, ids, torch.zeros_like(mask), prompt_len).item())


def test_a_negative_lm_coef_is_a_config_error(tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text("kind: srm\n")
    with pytest.raises(ConfigError, match="lm_coef"):
        validate_rm_config(load_rm_config(path, ["train.lm_coef=-1"]), check_paths=False)


@pytest.mark.parametrize("key", ["train.weight_decay", "train.grad_clip", "train.log_every"])
def test_negative_rm_decay_clip_and_log_period_are_config_errors(tmp_path, key):
    path = tmp_path / "rm.yaml"
    path.write_text("kind: srm\n")
    with pytest.raises(ConfigError, match=rf"{key}=-1(\.0)? must be >= 0 \(0 = off\)"):
        validate_rm_config(load_rm_config(path, [f"{key}=-1"]), check_paths=False)
    validate_rm_config(load_rm_config(path, [f"{key}=0", "model.path=m", "data.train_path=t"]), check_paths=False)


def test_lm_coef_on_an_untied_backbone_is_refused_at_validation_before_any_weights_load(tmp_path):
    import json

    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    build_tiny_qwen2(str(tmp_path), build_char_tokenizer(str(tmp_path), "ab"), hidden_size=16, num_layers=1,
                     num_heads=2, num_kv_heads=1, intermediate_size=32)
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "a"}\n')
    overrides = [f"model.path={tmp_path}", f"data.train_path={tmp_path / 'pairs.jsonl'}", "train.lm_coef=0.5"]
    validate_rm_config(load_rm_config(None, overrides))  # tied: accepted
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    (tmp_path / "model.safetensors").unlink()  # the check reads config.json only
    with pytest.raises(ConfigError) as e:
        validate_rm_config(load_rm_config(None, overrides))
    assert str(e.value) == (f"train.lm_coef=0.5 needs a backbone whose LM head is tied to its input embedding, but "
                            f"model.path={tmp_path} has tie_word_embeddings=false; set train.lm_coef=0")
    validate_rm_config(load_rm_config(None, overrides[:2]))  # lm_coef 0: the untied backbone is fine
