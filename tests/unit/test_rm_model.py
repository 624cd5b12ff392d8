"""ScalarRewardModel: pooling, layers, heads, save/load round trip, RM config loading, reward sources."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from protocols import RewardItem
from streamrft.config.base import ConfigError
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
from streamrft.rm.config import load_rm_config, validate_rm_config
from streamrft.rm.model import ScalarRewardModel

ALPHABET = "0123456789+= "


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm_backbone")
    tok = build_char_tokenizer(str(out), ALPHABET)
    build_tiny_qwen2(str(out), tok, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32)
    return str(out)


def test_last_pooling_reads_the_hidden_state_at_the_last_non_pad_token(backbone):
    rm = ScalarRewardModel.from_backbone(backbone, layer=1, num_heads=3)
    ids, mask = rm.encode(["1+2=", "10+20="], ["3", "30"])
    assert mask.sum(1).tolist() == [6, 9]  # prompt + response + eos, right-padded
    with torch.no_grad():
        hidden = rm.backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[1]
        expected = rm.heads(torch.stack([hidden[0, 5], hidden[1, 8]]))
        assert torch.allclose(rm(ids, mask), expected, atol=1e-6)


def test_a_padded_row_scores_like_the_row_alone(backbone):
    for pooling in ("last", "attention"):
        rm = ScalarRewardModel.from_backbone(backbone, pooling=pooling, num_heads=2)
        together = rm.score(["1+2=", "10+20="], ["3", "30"])
        alone = rm.score(["1+2="], ["3"])
        assert together[0] == pytest.approx(alone[0], abs=1e-5)


def test_a_saved_rm_loads_with_the_same_rewards(backbone, tmp_path):
    rm = ScalarRewardModel.from_backbone(backbone, layer=-2, pooling="attention", num_heads=2)
    torch.nn.init.normal_(rm.attn.weight)
    rm.save_pretrained(tmp_path / "rm")
    loaded = ScalarRewardModel.from_pretrained(tmp_path / "rm")
    assert (loaded.layer, loaded.pooling, loaded.num_heads) == (-2, "attention", 2)
    assert loaded.score(["1+2=", "3+4="], ["3", "8"]) == pytest.approx(rm.score(["1+2=", "3+4="], ["3", "8"]), abs=1e-6)
    assert json.loads((tmp_path / "rm" / "rm.json").read_text())["kind"] == "srm"


def test_a_layer_out_of_range_names_the_key(backbone):
    with pytest.raises(ValueError, match=r"layer=3 is out of range .* 3 hidden states .* set model.layer"):
        ScalarRewardModel.from_backbone(backbone, layer=3)


def test_a_trained_rm_is_a_model_reward_source_scoring_in_batches(backbone, tmp_path):
    from streamrft.config.reward import RewardConfig, RewardSourceConfig
    from streamrft.rewards.scorer import build_reward_scorer

    rm = ScalarRewardModel.from_backbone(backbone)
    rm.save_pretrained(tmp_path / "rm")
    cfg = RewardConfig(sources=[RewardSourceConfig(name="rm", type="model", model_path=str(tmp_path / "rm"))])
    scorer = build_reward_scorer(cfg)
    items = [RewardItem(sample_id=str(i), prompt="1+2=", response=str(i)) for i in range(5)]
    outcomes = asyncio.run(scorer.score(items))
    expected = rm.score(["1+2="] * 5, [str(i) for i in range(5)])
    assert [o.reward for o in outcomes] == pytest.approx(expected, abs=1e-6)
    assert all(o.components["rm"] == o.reward for o in outcomes)


def test_a_model_source_without_a_trained_rm_is_a_config_error(tmp_path):
    from streamrft.config.reward import RewardConfig, RewardSourceConfig
    from streamrft.rewards.scorer import build_reward_scorer

    cfg = RewardConfig(sources=[RewardSourceConfig(name="rm", type="model", model_path=str(tmp_path))])
    with pytest.raises(ConfigError, match=r"reward source 'rm' \(reward.sources\[\*\].model_path\): .* \(no rm.json\)"):
        build_reward_scorer(cfg)


def test_rm_config_rejects_unknown_keys_and_applies_overrides(tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text("kind: srm\ntrain:\n  steps: 10\n")
    cfg = load_rm_config(path, ["train.loss=hps", "model.num_heads=2"])
    assert (cfg.train.steps, cfg.train.loss, cfg.model.num_heads) == (10, "hps", 2)
    with pytest.raises(ConfigError, match="unknown field `stepz`"):
        load_rm_config(path, ["train.stepz=3"])
    with pytest.raises(ConfigError, match="model.num_heads=0 must be >= 1"):
        validate_rm_config(load_rm_config(path, ["model.num_heads=0"]), check_paths=False)


def test_every_shipped_rm_pipeline_config_loads():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "pipelines"
    kinds = {load_rm_config(root / name / "config.yaml").kind for name in ("srm", "grm")}
    assert kinds == {"srm", "grm"}


def test_srm_only_settings_are_refused_for_a_judge_instead_of_ignored(tmp_path):
    cfg = load_rm_config(None, ["kind=grm", "model.path=x", "data.train_path=y", "train.lr_schedule=cosine"])
    with pytest.raises(ConfigError, match="train.lr_schedule='cosine' applies to scalar RMs only"):
        validate_rm_config(cfg, check_paths=False)


def test_the_cosine_schedule_decays_from_the_peak_to_zero():
    from streamrft.rm.train import lr_factor

    assert [lr_factor("cosine", i, 4) for i in (0, 2, 4)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_factor("constant", 3, 4) == 1.0


def test_the_srm_rl_config_validates_with_the_rm_as_its_only_reward():
    from pathlib import Path

    from streamrft.config import load_config, validate_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "pipelines" / "srm" / "rl.yaml")
    validate_config(cfg, 1, check_paths=False)
    assert [(s.type, s.model_path) for s in cfg.reward.sources] == [("model", "runs/srm/rm")]
