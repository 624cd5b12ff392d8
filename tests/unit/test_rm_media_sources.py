"""Issue 19 item 2, the paths test_rm_media.py leaves out: a generative judge on VIDEO (train-rm / eval-rm with
``kind: grm`` and ``data.video_field``, fed the processor's own video inputs), and an audio SRM and a video judge
as reward sources (``type: model``) and behind the reward service, their media sent as MediaRefs."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from protocols import RewardItem, RewardReply, RewardRequest, decode, encode

pytest.importorskip("av")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipelines.video_rm_rl.task import write_mp4  # noqa: E402
from pipelines.vision_srm.task import ALPHABET, write_media_pairs  # noqa: E402

VIDEO = {"image_field": "", "video_field": "video", "audio_field": "", "max_video_frames": 4, "video_fps": 0.0}
AUDIO = {"image_field": "", "video_field": "", "audio_field": "audio", "max_video_frames": 16, "video_fps": 0.0}
COLOURS = {"red": (230, 20, 20), "blue": (20, 30, 230)}


def _clip(d: Path, name: str, rgb) -> tuple[str, list[str]]:
    """A 4-frame 16x16 lossless mp4 (a coloured square sliding on black) and the same frames as PNG files."""
    frames = []
    for t in range(4):
        f = np.zeros((16, 16, 3), dtype=np.uint8)
        f[4:12, 2 * t:2 * t + 8] = rgb
        frames.append(f)
    pngs = []
    for i, f in enumerate(frames):
        pngs.append(str(d / f"{name}{i}.png"))
        Image.fromarray(f).save(pngs[-1])
    write_mp4(frames, d / f"{name}.mp4")  # lossless: the same pixels as the PNGs
    return str(d / f"{name}.mp4"), pngs


@pytest.fixture(scope="module")
def video_judgments(tmp_path_factory):
    """A tiny Qwen2-VL and pointwise judgment rows "does the response name the colour of the video?": the same
    four rows once with mp4 files (train) and once with the frame lists (held out)."""
    from streamrft.models.vl import build_tiny_qwen2_vl

    d = tmp_path_factory.mktemp("video_judge")
    backbone = build_tiny_qwen2_vl(str(d / "vl"), ALPHABET, num_layers=1)
    clips = {c: _clip(d, c, rgb) for c, rgb in COLOURS.items()}
    rows = [(c, answer) for c in COLOURS for answer in COLOURS]
    for name, which in (("files", 0), ("frames", 1)):
        with open(d / f"{name}.jsonl", "w") as f:
            for colour, answer in rows:
                f.write(json.dumps({"prompt": "colour?", "responses": [answer], "video": clips[colour][which],
                                    "judgment": "[[1]]" if answer == colour else "[[0]]"}) + "\n")
    return d, backbone, clips


def test_a_video_judge_reads_the_processors_video_inputs_from_a_file_or_its_frames(video_judgments):
    from streamrft.rm.config import GRMConfig
    from streamrft.rm.data import read_judgments
    from streamrft.rm.judge import GenerativeJudge
    from streamrft.models.vl import vl_inputs

    d, backbone, clips = video_judgments
    judge = GenerativeJudge.from_base(backbone, GRMConfig(), "pointwise", VIDEO)
    from_files = read_judgments(d / "files.jsonl", VIDEO)
    from_frames = read_judgments(d / "frames.jsonl", VIDEO)
    assert [r.kind for r in from_files[0].media] == ["video"] and len(from_frames[0].media) == 4
    for file_row, frame_row, colour in zip(from_files, from_frames, ["red", "red", "blue", "blue"]):
        prompt = judge.judge_prompt(file_row.prompt, file_row.responses)
        expected = vl_inputs(judge.processor, prompt, [], [[Image.open(p).convert("RGB") for p in clips[colour][1]]])
        for row in (file_row, frame_row):
            got = judge.media_inputs.row(prompt, row.media, "t")
            assert sorted(got) == sorted(expected) and "pixel_values_videos" in got
            for key in expected:
                assert got[key].equal(expected[key]), key
        assert int(expected["video_grid_thw"][0, 0]) == 2  # 4 frames, temporal patch 2


def test_train_rm_fits_a_video_judge_on_the_processors_inputs_and_it_scores_video_refs_in_rl_and_the_service(
        video_judgments, capsys):
    """train-rm kind=grm with data.video_field on one mp4 row: the first step's loss is the judgment's NLL under
    the base model given vl_inputs() of the decoded frames (HF's own M-RoPE, no padding); the fitted judge gives
    the verdict on the frame-list copy (eval split), through eval-rm, a `type: model` source and the service."""
    from streamrft.models.multimodal import load_multimodal_policy
    from streamrft.models.vl import vl_inputs
    from streamrft.rewards.service import RewardService
    from streamrft.rewards.sources import resolve_reward_function
    from streamrft.rm.cli import eval_rm_main, train_rm_main
    from streamrft.rm.data import read_judgments
    from streamrft.rm.reward import ModelReward

    d, backbone, clips = video_judgments
    (d / "one.jsonl").write_text((d / "files.jsonl").read_text().splitlines()[0] + "\n")  # red video, "red", [[1]]
    (d / "one_frames.jsonl").write_text((d / "frames.jsonl").read_text().splitlines()[0] + "\n")
    model, processor, _ = load_multimodal_policy(backbone)
    target = processor.tokenizer("[[1]]", add_special_tokens=False)["input_ids"] + [processor.tokenizer.eos_token_id]
    nll = {}
    with torch.no_grad():
        for colour in COLOURS:
            frames = [Image.open(p).convert("RGB") for p in clips[colour][1]]
            inputs = vl_inputs(processor, "Q:colour? A:red V:", [], [frames])  # grm.single_template
            P = inputs["input_ids"].shape[1]
            ids = torch.cat([inputs["input_ids"], torch.tensor([target])], dim=1)
            full = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "mm_token_type_ids": torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(target)))}
            logp = torch.log_softmax(model(**full).logits[0], -1)
            nll[colour] = -sum(logp[P + t - 1, tok].item() for t, tok in enumerate(target)) / len(target)
    assert abs(nll["red"] - nll["blue"]) > 1e-4  # the video's pixels reach the loss

    out = d / "judge"
    assert train_rm_main(["/dev/null", "kind=grm", f"model.path={backbone}", f"data.train_path={d / 'one.jsonl'}",
                          f"data.eval_path={d / 'one_frames.jsonl'}", "data.video_field=video",
                          "data.max_video_frames=4", "grm.max_new_tokens=5", "train.steps=30", "train.batch_size=2",
                          "train.lr=1e-2", "train.log_every=1", f"output_dir={out}"]) == 0
    summary = json.loads(capsys.readouterr().out.split("summary: ")[-1])
    losses = [json.loads(ln)["loss"] for ln in (out / "train.jsonl").read_text().splitlines()[:-1]]
    assert losses[0] == pytest.approx(nll["red"], rel=1e-4) and losses[-1] < 0.1 * losses[0]
    assert summary["eval_verdict_accuracy"] == 1.0  # held out as the frame list of the mp4 it trained on
    assert json.loads((out / "rm.json").read_text())["media"] == VIDEO
    assert eval_rm_main(["--model", str(out), "--data", str(d / "one.jsonl")]) == 0  # media fields from rm.json
    assert json.loads(capsys.readouterr().out)["verdict_accuracy"] == 1.0

    rows = read_judgments(d / "files.jsonl", VIDEO)
    items = [RewardItem(sample_id=f"s{i}", prompt=r.prompt, response=r.responses[0], media=list(r.media))
             for i, r in enumerate(rows)]
    rewards = asyncio.run(ModelReward(str(out), device="cpu").score(items))  # a `type: model` source
    assert rewards[0] == 1.0 and all(r in (0.0, 1.0) for r in rewards)  # pointwise verdicts [[1]] / [[0]]
    service = RewardService(resolve_reward_function(f"model:{out}"))  # what `serve-reward --fn model:DIR` runs
    request = encode(RewardRequest(request_id="r", items=items))
    assert all(Path(c[0]).read_bytes()[:64] not in request for c in clips.values())  # refs on the wire, not mp4s
    assert len(request) < sum(len(it.media[0].path) + 300 for it in items)  # path + hash + small fields
    reply = decode(asyncio.run(service.answer_frame(request)), RewardReply)
    assert reply.error == "" and reply.rewards == rewards


@pytest.fixture(scope="module")
def audio_rm(tmp_path_factory):
    from streamrft.models.audio import build_tiny_qwen2_audio
    from streamrft.rm.model import ScalarRewardModel

    d = tmp_path_factory.mktemp("audio_rm")
    backbone = build_tiny_qwen2_audio(str(d / "al"), ALPHABET, num_layers=1)
    rm = ScalarRewardModel.from_backbone(backbone, num_heads=2, media=AUDIO)
    torch.nn.init.normal_(rm.heads.weight)
    rm.save_pretrained(d / "rm")
    return d, rm, write_media_pairs(d, "pairs", 3, seed=0, kind="audio")


def test_an_audio_srm_scores_audio_refs_as_a_model_source_and_behind_the_service(audio_rm):
    from streamrft.config.reward import RewardConfig, RewardSourceConfig
    from streamrft.rewards.scorer import build_reward_scorer
    from streamrft.rewards.service import RewardService
    from streamrft.rewards.sources import resolve_reward_function
    from streamrft.rm.data import read_preference_pairs

    d, rm, pairs_path = audio_rm
    pairs = read_preference_pairs(pairs_path, AUDIO)
    assert [r.kind for p in pairs for r in p.media] == ["audio"] * 3
    items = [RewardItem(sample_id=f"s{i}-{k}", prompt=p.prompt, response=r, media=list(p.media))
             for i, p in enumerate(pairs) for k, r in enumerate((p.chosen, p.rejected))]
    expected = rm.score([it.prompt for it in items], [it.response for it in items], media=[it.media for it in items])
    assert len({round(x, 4) for x in expected}) > 2  # the tone and the response both reach the reward
    scorer = build_reward_scorer(RewardConfig(sources=[RewardSourceConfig(name="rm", type="model",
                                                                         model_path=str(d / "rm"))]))
    assert [o.reward for o in asyncio.run(scorer.score(items))] == pytest.approx(expected, abs=1e-5)

    gone = type(items[0].media[0])(path=str(d / "gone.wav"), sha256=items[0].media[0].sha256, kind="audio",
                                   field="audio")
    bad = RewardItem(sample_id="bad", prompt="note?", response="c", media=[gone])
    service = RewardService(resolve_reward_function(f"model:{d / 'rm'}"))
    request = encode(RewardRequest(request_id="r", items=[*items, bad]))
    assert b"RIFF" not in request  # the wav files stay on disk
    reply = decode(asyncio.run(service.answer_frame(request)), RewardReply)
    assert reply.rewards[:-1] == pytest.approx(expected, abs=1e-5)
    assert math.isnan(reply.rewards[-1]) and service.n_item_failures == 1  # the missing file fails alone


def test_rl_validation_takes_an_audio_rm_for_audio_prompts_only(audio_rm):
    from types import SimpleNamespace

    from streamrft.config.base import ConfigError
    from streamrft.config.data import DataConfig
    from streamrft.config.reward import RewardConfig, RewardSourceConfig
    from streamrft.rewards.validate import validate_reward_paths

    d, _, _ = audio_rm
    reward = RewardConfig(sources=[RewardSourceConfig(name="rm", type="model", model_path=str(d / "rm"))])
    validate_reward_paths(SimpleNamespace(reward=reward, data=DataConfig(audio_field="clip")))
    message = ("reward.sources[0] ('rm').model_path: the reward model reads each prompt's audio (trained "
               "with data.audio_field='audio') but this run's data has none; set data.audio_field")
    with pytest.raises(ConfigError) as e:
        validate_reward_paths(SimpleNamespace(reward=reward, data=DataConfig(image_field="image")))
    assert str(e.value) == message
    # prompts given as messages carry their media as content parts, with no data.*_field
    for kind, ok in (("audio", True), ("image", False)):
        rows = d / f"messages_{kind}.jsonl"
        rows.write_text(json.dumps({"prompt": [{"role": "user", "content": [
            {"type": kind, kind: f"x.{kind}"}, {"type": "text", "text": "note?"}]}], "reference": "c"}) + "\n")
        cfg = SimpleNamespace(reward=reward, data=DataConfig(train_path=str(rows)))
        if ok:
            validate_reward_paths(cfg)
        else:
            with pytest.raises(ConfigError) as e:
                validate_reward_paths(cfg)
            assert str(e.value) == message


def test_the_chosen_lm_loss_of_an_audio_srm_uses_its_own_untied_lm_head_after_the_expanded_placeholders(audio_rm):
    """train.lm_coef on Qwen2-Audio (whose LM head is not tied to its embedding): the LM term equals each
    chosen row alone through the model's own logits, with the processor's prompt-only length as the prompt."""
    from streamrft.models.multimodal import forward_kwargs
    from streamrft.rm.data import read_preference_pairs
    from streamrft.rm.train import pair_batch_loss

    _, rm, pairs_path = audio_rm
    assert rm.backbone.get_output_embeddings().weight.data_ptr() != rm.backbone.get_input_embeddings().weight.data_ptr()
    pairs = read_preference_pairs(pairs_path, AUDIO)
    pairs[0].chosen += "ee"  # rows of different lengths: left padding
    rm.eval()
    codec, eos = rm.media_inputs.codec, rm.tokenizer.eos_token
    nll, n_tokens = 0.0, 0
    with torch.no_grad():
        for p in pairs:
            prompt_len = codec.inputs(p.prompt, p.media, "t")["input_ids"].shape[1]
            assert prompt_len > len(p.prompt) + 2  # the audio placeholder expanded to one token per encoder frame
            row = codec.inputs(p.prompt + p.chosen + eos, p.media, "t")
            ids = row["input_ids"][0]
            logp = torch.log_softmax(rm.backbone(**forward_kwargs(rm.backbone, row), use_cache=False).logits[0], -1)
            nll -= sum(logp[t - 1, ids[t]].item() for t in range(prompt_len, len(ids)))
            n_tokens += len(ids) - prompt_len
        assert n_tokens == sum(len(p.chosen) + 1 for p in pairs)
        pair_only = pair_batch_loss(rm, pairs, "bradley_terry", 1.0, 0.0)[0].item()
        with_lm = pair_batch_loss(rm, pairs, "bradley_terry", 1.0, 2.0)[0].item()
    assert with_lm - pair_only == pytest.approx(2.0 * nll / n_tokens, rel=1e-5)
