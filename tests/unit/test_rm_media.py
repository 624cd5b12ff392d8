"""Reward models on media rows (issue 19 item 2), fast checks on a tiny Qwen2-VL: row reading errors, config
checks, padding invariance, save/load, eval-rm on media rows, ModelReward on items carrying MediaRefs."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from protocols import RewardItem, decode, encode
from streamrft.config.base import ConfigError
from streamrft.data.media import MediaError
from streamrft.rm.config import RMDataConfig, RMModelConfig, RMTrainConfig, validate_rm_config
from streamrft.rm.data import read_judgments, read_preference_pairs
from streamrft.rm.model import ScalarRewardModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipelines.vision_srm.task import ALPHABET, write_image_judgments, write_media_pairs  # noqa: E402

IMAGE = {"image_field": "image", "video_field": "", "audio_field": "", "max_video_frames": 16, "video_fps": 0.0}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from streamrft.models.vl import build_tiny_qwen2_vl

    root = tmp_path_factory.mktemp("rm_media")
    backbone = build_tiny_qwen2_vl(str(root / "vl"), ALPHABET, num_layers=1)
    pairs = write_media_pairs(root, "pairs", 6, seed=0, kind="image")
    return root, backbone, pairs


def test_media_pairs_carry_refs_and_a_missing_field_or_file_names_file_row_field(vl, tmp_path):
    root, _, pairs_path = vl
    pairs = read_preference_pairs(pairs_path, IMAGE)
    first = json.loads(Path(pairs_path).read_text().splitlines()[0])
    assert [(r.path, r.kind, r.field) for r in pairs[0].media] == [(first["image"], "image", "image")]
    assert read_preference_pairs(pairs_path)[0].media == []  # text reading ignores the field
    rows = [dict(first), {k: v for k, v in first.items() if k != "image"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(MediaError, match=rf"^{bad} row 1 field 'image': the row has no media field 'image'"):
        read_preference_pairs(bad, IMAGE)
    rows[1]["image"] = str(tmp_path / "gone.png")
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(MediaError, match=rf"^{bad} row 1 field 'image': image file '.*gone.png' does not exist"):
        read_preference_pairs(bad, IMAGE)
    judged = read_judgments(write_image_judgments(tmp_path, "j", 3, seed=0), IMAGE)
    assert all(len(r.media) == 1 and r.media[0].kind == "image" for r in judged)


def test_config_checks_media_fields_against_the_backbone(vl, tmp_path):
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    root, backbone, pairs = vl
    text = str(tmp_path / "text")
    build_tiny_qwen2(text, build_char_tokenizer(text, ALPHABET), hidden_size=16, num_layers=1, num_heads=2,
                     num_kv_heads=1, intermediate_size=32)
    cfg = RMTrainConfig(model=RMModelConfig(path=text), data=RMDataConfig(train_path=pairs, image_field="image"))
    with pytest.raises(ConfigError, match=r"data.image_field='image' needs a vision-language backbone \(Qwen2-VL\), "
                                          r"but model.path=.* is a 'qwen2' model"):
        validate_rm_config(cfg)
    cfg = RMTrainConfig(model=RMModelConfig(path=backbone), data=RMDataConfig(train_path=pairs))
    with pytest.raises(ConfigError, match=r"is a qwen2_vl model but no media field is set; set data.image_field"):
        validate_rm_config(cfg)
    cfg = RMTrainConfig(model=RMModelConfig(path=backbone), data=RMDataConfig(train_path=pairs, audio_field="audio"))
    with pytest.raises(ConfigError, match=r"data.audio_field='audio' needs an audio-language backbone"):
        validate_rm_config(cfg)
    cfg = RMTrainConfig(model=RMModelConfig(path=backbone), data=RMDataConfig(train_path=pairs, image_field="image"))
    validate_rm_config(cfg)
    cfg.train.lm_coef = 0.5  # the chosen-response LM loss counts the expanded placeholders as prompt
    validate_rm_config(cfg)


def test_a_left_padded_media_row_scores_like_the_row_alone_and_the_image_matters(vl):
    _, backbone, pairs_path = vl
    pairs = read_preference_pairs(pairs_path, IMAGE)
    rm = ScalarRewardModel.from_backbone(backbone, num_heads=2, media=IMAGE)
    prompts = [pairs[0].prompt, pairs[1].prompt]
    responses = ["red", "yellow"]  # different lengths: row 0 is left-padded
    together = rm.score(prompts, responses, media=[pairs[0].media, pairs[1].media])
    alone = rm.score(prompts[:1], responses[:1], media=[pairs[0].media])
    assert together[0] == pytest.approx(alone[0], abs=1e-5)
    other = next(p for p in pairs if p.chosen != pairs[0].chosen)
    swapped = rm.score(prompts[:1], responses[:1], media=[other.media])
    assert abs(swapped[0] - alone[0]) > 1e-6  # the pixels reach the reward
    with pytest.raises(ValueError, match=r"this reward model reads media .* give one list of media refs per row"):
        rm.score(prompts, responses)


def test_saved_media_rm_round_trips_and_eval_rm_reads_its_media_fields(vl, tmp_path, capsys):
    from streamrft.rm.cli import eval_rm_main

    _, backbone, pairs_path = vl
    pairs = read_preference_pairs(pairs_path, IMAGE)
    rm = ScalarRewardModel.from_backbone(backbone, pooling="attention", media=IMAGE)
    torch.nn.init.normal_(rm.attn.weight)
    rm.save_pretrained(tmp_path / "rm")
    assert json.loads((tmp_path / "rm" / "rm.json").read_text())["media"] == IMAGE
    loaded = ScalarRewardModel.from_pretrained(tmp_path / "rm")
    media = [p.media for p in pairs]
    prompts, chosen, rejected = [p.prompt for p in pairs], [p.chosen for p in pairs], [p.rejected for p in pairs]
    r_c, r_r = loaded.score(prompts, chosen, media=media), loaded.score(prompts, rejected, media=media)
    assert r_c == pytest.approx(rm.score(prompts, chosen, media=media), abs=1e-5)
    assert eval_rm_main(["--model", str(tmp_path / "rm"), "--data", pairs_path]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n_pairs"] == len(pairs)
    assert result["pairwise_accuracy"] == pytest.approx(sum(c > r for c, r in zip(r_c, r_r)) / len(pairs))


def test_model_reward_scores_media_refs_and_fails_only_the_bad_item(vl, tmp_path):
    from streamrft.rm.reward import ModelReward

    _, backbone, pairs_path = vl
    pairs = read_preference_pairs(pairs_path, IMAGE)
    ScalarRewardModel.from_backbone(backbone, media=IMAGE).save_pretrained(tmp_path / "rm")
    reward = ModelReward(str(tmp_path / "rm"), device="cpu")
    items = [RewardItem(sample_id=f"s{i}", prompt=p.prompt, response=p.chosen, media=list(p.media))
             for i, p in enumerate(pairs[:3])]
    wire = decode(encode(RewardItem(sample_id="x", prompt="colour?", response="red", media=list(pairs[0].media))),
                  RewardItem)
    assert wire.media == list(pairs[0].media)  # refs cross the wire as path + sha256, never pixels
    assert len(encode(wire)) < 400
    expected = reward.rm.score([it.prompt for it in items], [it.response for it in items],
                               media=[it.media for it in items])
    assert asyncio.run(reward.score(items)) == pytest.approx(expected, abs=1e-5)
    changed = tmp_path / "changed.png"
    changed.write_bytes(Path(pairs[1].media[0].path).read_bytes())
    bad_ref = type(pairs[1].media[0])(path=str(changed), sha256=pairs[1].media[0].sha256, kind="image", field="image")
    changed.write_bytes(Path(pairs[2].media[0].path).read_bytes())  # content differs from the recorded hash now
    no_media = RewardItem(sample_id="bare", prompt="colour?", response="red")
    out = asyncio.run(reward.score([items[0], msgspec.structs.replace(items[1], media=[bad_ref]), no_media]))
    assert out[0] == pytest.approx(expected[0], abs=1e-5)
    assert isinstance(out[1], ValueError) and "changed since it was referenced" in str(out[1])
    assert str(out[1]).startswith("sample s1: ")
    assert isinstance(out[2], ValueError) and str(out[2]).startswith(
        "sample bare: this reward model reads the prompt's media (image_field='image') but the item has no media refs")



def test_rl_validation_refuses_a_media_rm_for_prompts_without_media(vl, tmp_path):
    from types import SimpleNamespace

    from streamrft.config.data import DataConfig
    from streamrft.config.reward import RewardConfig, RewardSourceConfig
    from streamrft.rewards.validate import validate_reward_paths

    _, backbone, _ = vl
    ScalarRewardModel.from_backbone(backbone, media=IMAGE).save_pretrained(tmp_path / "rm")
    reward = RewardConfig(sources=[RewardSourceConfig(name="rm", type="model", model_path=str(tmp_path / "rm"))])
    validate_reward_paths(SimpleNamespace(reward=reward, data=DataConfig(video_field="video")))
    with pytest.raises(ConfigError, match=r"^reward.sources\[0\] \('rm'\).model_path: the reward model reads each "
                                          r"prompt's image/video .* set data.image_field or data.video_field$"):
        validate_reward_paths(SimpleNamespace(reward=reward, data=DataConfig(audio_field="audio")))


def test_reward_stage_scores_a_completion_with_a_media_rm_source_from_its_refs(vl, tmp_path):
    """The RL path: the reward stage builds the RewardItem from the Completion (media by reference) and a
    ``type: model`` source on a media RM scores prompt media + response."""
    from protocols import Completion
    from streamrft.config.reward import RewardConfig, RewardSourceConfig
    from streamrft.rewards.scorer import build_reward_scorer
    from streamrft.runtime.accounting import Accounting
    from streamrft.runtime.scoring import RewardScorerStage
    from streamrft.runtime.stage import StageContext

    _, backbone, pairs_path = vl
    pair = read_preference_pairs(pairs_path, IMAGE)[0]
    rm = ScalarRewardModel.from_backbone(backbone, media=IMAGE)
    rm.save_pretrained(tmp_path / "rm")
    scorer = build_reward_scorer(RewardConfig(sources=[RewardSourceConfig(name="rm", type="model",
                                                                   model_path=str(tmp_path / "rm"))]))

    class Outbox:
        sent: list = []

        async def send(self, msg, tensors, timeout=None):
            self.sent.append(msg)

    outbox = Outbox()
    stage = RewardScorerStage(StageContext(rank=0, stage_timeout_s=5.0, accounting=Accounting()), None, outbox, scorer, 1)
    completion = Completion(sample_id="g-0", group_id="g", step=0, prompt_index=0, sample_index=0,
                            prompt_text=pair.prompt, response_text=pair.chosen, n_samples=1, finish_reason="stop",
                            policy_version=0, prompt_len=1, response_len=1, media=list(pair.media))
    asyncio.run(stage.process(completion, None))
    (scored,) = outbox.sent
    assert scored.status == "ok", scored.fail_reason
    assert scored.reward == pytest.approx(rm.score([pair.prompt], [pair.chosen], media=[pair.media])[0], abs=1e-5)


def test_a_video_rm_scores_a_video_file_like_its_frame_list(vl, tmp_path):
    """Video rows (data.video_field): a list of frame images and the lossless mp4 of the same frames are the
    same model inputs, so they get the same reward; frames are capped by max_video_frames like in RL."""
    pytest.importorskip("av")
    from pipelines.video_rm_rl.task import write_mp4
    import numpy as np
    from PIL import Image

    _, backbone, _ = vl
    frames = []
    for t in range(4):  # a white square sliding right
        f = np.zeros((16, 16, 3), dtype=np.uint8)
        f[4:8, 3 * t:3 * t + 4] = 255
        frames.append(f)
    paths = []
    for i, f in enumerate(frames):
        paths.append(str(tmp_path / f"f{i}.png"))
        Image.fromarray(f).save(paths[-1])
    write_mp4(frames, tmp_path / "clip.mp4")  # lossless: same pixels as the PNGs
    rows = [{"prompt": "way?", "chosen": "r", "rejected": "l", "video": paths},
            {"prompt": "way?", "chosen": "r", "rejected": "l", "video": str(tmp_path / "clip.mp4")}]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    video = {**IMAGE, "image_field": "", "video_field": "video", "max_video_frames": 4}
    as_frames, as_file = read_preference_pairs(tmp_path / "v.jsonl", video)
    assert [r.kind for r in as_frames.media] == ["video_frame"] * 4 and [r.kind for r in as_file.media] == ["video"]
    rm = ScalarRewardModel.from_backbone(backbone, media=video)
    got = rm.score(["way?"] * 2, ["r"] * 2, media=[as_frames.media, as_file.media])
    assert got[0] == pytest.approx(got[1], abs=1e-6)
    still = rm.score(["way?"], ["r"], media=[as_frames.media[:1] * 4])  # a still clip is another input
    assert abs(still[0] - got[0]) > 1e-6


def test_a_media_judge_writes_the_same_verdict_batched_or_alone_and_learns_a_row(vl, tmp_path):
    from streamrft.rm.config import GRMConfig
    from streamrft.rm.judge import GenerativeJudge, train_media_judge

    _, backbone, _ = vl
    rows = read_judgments(write_image_judgments(tmp_path, "j", 4, seed=0), IMAGE)
    judge = GenerativeJudge.from_base(backbone, GRMConfig(max_new_tokens=5), "pairwise", IMAGE)
    prompts = [judge.judge_prompt(r.prompt, r.responses) for r in rows]
    prompts[1] += "red"  # rows of different lengths: left padding in the batch
    together = judge.generate(prompts, media=[r.media for r in rows])
    alone = [judge.generate([p], media=[r.media])[0] for p, r in zip(prompts, rows)]
    assert together == alone
    losses = train_media_judge(judge, rows[:1], steps=40, lr=1e-2, batch_size=1, seed=0, log_every=0)
    assert losses[-1] < 0.1 * losses[0]
    assert judge.generate(prompts[:1], media=[rows[0].media]) == [rows[0].judgment]  # it can fit one verdict
    judge.save_pretrained(tmp_path / "judge")
    loaded = GenerativeJudge.from_pretrained(tmp_path / "judge")
    assert loaded.media == IMAGE and loaded.generate(prompts[:1], media=[rows[0].media]) == [rows[0].judgment]


def test_hps_and_tie_losses_on_media_pairs_match_their_formulas(vl):
    import math

    from streamrft.rm.train import pair_batch_loss

    _, backbone, pairs_path = vl
    pairs = read_preference_pairs(pairs_path, IMAGE)[:4]
    pairs[1].tie = True
    rm = ScalarRewardModel.from_backbone(backbone, media=IMAGE)
    rm.eval()
    r_c = rm.score([p.prompt for p in pairs], [p.chosen for p in pairs], media=[p.media for p in pairs])
    r_r = rm.score([p.prompt for p in pairs], [p.rejected for p in pairs], media=[p.media for p in pairs])
    T = 0.5

    def logp_first(a, b):  # log softmax([a, b] / T)[0]
        return a / T - math.log(math.exp(a / T) + math.exp(b / T))

    expected = [-(0.5 * (logp_first(c, r) + logp_first(r, c)) if p.tie else logp_first(c, r))
                for p, c, r in zip(pairs, r_c, r_r)]
    with torch.no_grad():
        loss, got_c, got_r = pair_batch_loss(rm, pairs, "hps", T)
    assert got_c[:, 0].tolist() == pytest.approx(r_c, abs=1e-5) and got_r[:, 0].tolist() == pytest.approx(r_r, abs=1e-5)
    assert loss.item() == pytest.approx(sum(expected) / len(expected), abs=1e-5)


def test_the_chosen_lm_loss_on_media_pairs_skips_the_expanded_placeholders_and_the_prompt(vl):
    """train.lm_coef with media: the LM term equals an independent computation that runs each chosen row alone
    (no padding) and takes the prompt length from the processor's own prompt-only inputs (placeholders
    expanded to one token per merged patch), so only the response and eos tokens carry loss."""
    from streamrft.models.multimodal import forward_kwargs
    from streamrft.rm.train import pair_batch_loss

    _, backbone, pairs_path = vl
    pairs = read_preference_pairs(pairs_path, IMAGE)[:3]
    pairs[1].chosen += "low"  # rows of different lengths: the batch is left-padded
    rm = ScalarRewardModel.from_backbone(backbone, media=IMAGE)
    rm.eval()
    codec, eos = rm.media_inputs.codec, rm.tokenizer.eos_token
    nll, n_tokens, expanded = 0.0, 0, []
    with torch.no_grad():
        for p in pairs:
            prompt_len = codec.inputs(p.prompt, p.media, "t")["input_ids"].shape[1]
            row = codec.inputs(p.prompt + p.chosen + eos, p.media, "t")
            ids = row["input_ids"][0]
            logp = torch.log_softmax(rm.backbone(**forward_kwargs(rm.backbone, row), use_cache=False).logits[0], -1)
            for t in range(prompt_len, len(ids)):
                nll -= logp[t - 1, ids[t]].item()
                n_tokens += 1
            expanded.append(prompt_len - len(rm.tokenizer(p.prompt)["input_ids"]))
        assert n_tokens == sum(len(p.chosen) + 1 for p in pairs)  # char tokenizer: response + eos
        assert min(expanded) > 1  # the image placeholder became several tokens
        for coef in (0.0, 1.0, 0.5):
            loss, _, _ = pair_batch_loss(rm, pairs, "bradley_terry", 1.0, coef)
            if coef == 0.0:
                pair_only = loss.item()
            else:
                assert loss.item() - pair_only == pytest.approx(coef * nll / n_tokens, rel=1e-5)
