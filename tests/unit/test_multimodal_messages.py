"""Multimodal message prompts (Qwen2-VL / Qwen2-Audio part formats): a prompt given as messages whose content has
image / video / audio parts is rendered with the processor's chat template and its media go through the media
path of data.image_field / video_field / audio_field: the same refs, the same prompt ids, the same pixel / audio
tensors as the same row given as text with the media in a field (tiny Qwen2-VL and Qwen2-Audio built here)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from streamrft.config import ConfigError, load_config
from streamrft.config.validate import validate_chat_template_present
from streamrft.data import DataError, PromptDataset
from streamrft.data.chat import has_media_parts, media_parts
from streamrft.models.media_inputs import MediaCodec, load_processor

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 ?:"
# Qwen2-VL's chat template, reduced to what the tiny character tokenizer spells (no newlines): every image /
# video / audio part becomes its model's placeholder block, text parts their text
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}:{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
            "{% elif p['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>{% elif p['type'] == 'text' %}"
            "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


def _data_cfg(**kw) -> SimpleNamespace:
    base = dict(image_field="", video_field="", audio_field="", max_video_frames=0, video_fps=0.0)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2-VL whose processor carries a chat template (as Qwen2-VL-Instruct's chat_template.json)."""
    from streamrft.models.vl import build_tiny_qwen2_vl

    path = build_tiny_qwen2_vl(str(tmp_path_factory.mktemp("vl")), ALPHABET)
    processor = load_processor(path)
    processor.chat_template = TEMPLATE
    processor.save_pretrained(path)
    return Path(path)


@pytest.fixture(scope="module")
def media_files(tmp_path_factory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(32, 24), (20, 28), (24, 24), (24, 24)]):
        paths.append(d / f"{i}.png")
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    wav = d / "tone.wav"
    sf.write(wav, np.sin(np.arange(8000) * 2 * np.pi * 440 / 16000).astype(np.float32), 16000)
    return SimpleNamespace(images=[str(p) for p in paths], wav=str(wav))


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _same_inputs(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_image_and_video_parts_equal_the_same_row_with_image_and_video_fields(vl_dir, media_files, tmp_path):
    img, frames = media_files.images[0], media_files.images[2:4]
    messages = [{"role": "user", "content": [{"type": "image", "image": img},
                                             {"type": "text", "text": "how many dots?"},
                                             {"type": "video", "video": frames}]}]
    processor = load_processor(str(vl_dir))
    parts = _write(tmp_path / "parts.jsonl", [{"prompt": messages, "reference": "3"}])
    codec = MediaCodec.from_config(processor, _data_cfg(), message_media=True)
    text, refs, inputs = codec.prompt(PromptDataset(parts)[0], parts, "prompt")
    # the processor's chat template (auto) rendered every part as its placeholder, in order
    assert text == ("<|im_start|>user:<|vision_start|><|image_pad|><|vision_end|>how many dots?"
                    "<|vision_start|><|video_pad|><|vision_end|><|im_end|><|im_start|>assistant:")
    assert text == processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # the same row as text, its media in data.image_field / data.video_field
    fields = _write(tmp_path / "fields.jsonl", [{"prompt": text, "reference": "3", "image": img, "video": frames}])
    field_codec = MediaCodec.from_config(processor, _data_cfg(image_field="image", video_field="video"))
    f_text, f_refs, f_inputs = field_codec.prompt(PromptDataset(fields)[0], fields, "prompt")
    assert f_text == text
    assert [(r.path, r.sha256, r.kind, r.group) for r in refs] == [(r.path, r.sha256, r.kind, r.group) for r in f_refs]
    assert [r.kind for r in refs] == ["image", "video_frame", "video_frame"]
    assert {r.field for r in refs} == {"prompt"}  # errors name the prompt field
    _same_inputs(inputs, f_inputs)
    assert inputs["pixel_values"].shape[0] > 0 and "pixel_values_videos" in inputs
    # the learner re-builds the inputs from (prompt_text, refs) alone: the same ids and pixels
    _same_inputs(MediaCodec(processor).inputs(text, refs, "sample 0"), inputs)


def test_a_chat_template_file_and_system_prompt_apply_to_media_messages(vl_dir, media_files, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE.replace(":", " says:"))
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                             {"type": "image", "image": media_files.images[1]}]}]
    path = _write(tmp_path / "p.jsonl", [{"prompt": messages, "reference": "x"}])
    processor = load_processor(str(vl_dir))
    codec = MediaCodec.from_config(processor, _data_cfg(), message_media=True)
    text, refs, inputs = codec.prompt(PromptDataset(path)[0], path, "prompt", str(template), "be brief")
    assert text == ("<|im_start|>system says:be brief<|im_end|><|im_start|>user says:what is it?<|vision_start|>"
                    "<|image_pad|><|vision_end|><|im_end|><|im_start|>assistant says:")
    # what the processor itself gives for that text and the decoded image
    direct = processor(text=[text], images=[Image.open(media_files.images[1]).convert("RGB")], return_tensors="pt")
    _same_inputs(inputs, dict(direct))


def test_audio_parts_equal_the_same_row_with_an_audio_field(media_files, tmp_path):
    from streamrft.models.audio import build_tiny_qwen2_audio

    model_dir = build_tiny_qwen2_audio(str(tmp_path / "audio"), ALPHABET)
    processor = load_processor(model_dir)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": media_files.wav},
                                             {"type": "text", "text": "which note?"}]}]
    parts = _write(tmp_path / "parts.jsonl", [{"prompt": messages, "reference": "a"}])
    template = tmp_path / "t.jinja"  # the tiny audio processor has no chat template of its own
    template.write_text(TEMPLATE)
    text, refs, inputs = MediaCodec.from_config(processor, _data_cfg(), message_media=True).prompt(
        PromptDataset(parts)[0], parts, "prompt", str(template))
    assert text.startswith("<|im_start|>user:<|audio_bos|><|AUDIO|><|audio_eos|>which note?")
    fields = _write(tmp_path / "fields.jsonl", [{"prompt": text, "reference": "a", "audio": media_files.wav}])
    f_text, f_refs, f_inputs = MediaCodec.from_config(processor, _data_cfg(audio_field="audio")).prompt(
        PromptDataset(fields)[0], fields, "prompt")
    assert [(r.sha256, r.kind) for r in refs] == [(r.sha256, r.kind) for r in f_refs] == [(refs[0].sha256, "audio")]
    _same_inputs(inputs, f_inputs)
    assert "input_features" in inputs


def test_bad_parts_and_mixing_parts_with_fields_are_errors_naming_row_message_and_part(vl_dir, media_files, tmp_path):
    loc = "train.jsonl: row 4 field 'prompt'"
    with pytest.raises(DataError) as err:
        media_parts([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}], loc)
    assert str(err.value) == (f"{loc} message 0 part 1: the image part has no 'image' value; give it as "
                              "{'type': 'image', 'image': PATH}")
    with pytest.raises(DataError, match=r"message 1 part 0: a content part must be \{'type': 'text' \| 'image' \| "
                                        r"'video' \| 'audio', \.\.\.\} \(got type 'image_url'\)"):
        media_parts([{"role": "system", "content": "s"},
                     {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], loc)
    assert not has_media_parts([{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    # a missing image file: a MediaError naming file, row, message and part (the sample fails, the run goes on)
    path = _write(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": [
        {"type": "image", "image": str(tmp_path / "gone.png")}]}], "reference": "1"}])
    codec = MediaCodec.from_config(load_processor(str(vl_dir)), _data_cfg(), message_media=True)
    with pytest.raises(ValueError, match=rf"m.jsonl: row 0 field 'prompt' message 0 part 0: image file "
                                         rf"'{tmp_path / 'gone.png'}' does not exist"):
        codec.prompt(PromptDataset(path)[0], path, "prompt")
    both = MediaCodec.from_config(load_processor(str(vl_dir)), _data_cfg(image_field="image"))
    with pytest.raises(DataError, match=r"row 0 field 'prompt': the prompt is a list of messages and "
                                        r"data.image_field is set; give message prompts their media as content parts"):
        both.prompt(PromptDataset(path)[0], path, "prompt")


def test_the_config_check_needs_a_multimodal_model_for_media_parts(vl_dir, media_files, tmp_path):
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    rows = [{"prompt": [{"role": "user", "content": [{"type": "image", "image": media_files.images[0]},
                                                     {"type": "text", "text": "what?"}]}], "reference": "1"}]
    path = _write(tmp_path / "train.jsonl", rows)
    validate_chat_template_present(load_config(None, [f"model.path={vl_dir}", f"data.train_path={path}"]))
    text_model = tmp_path / "text"
    build_tiny_qwen2(str(text_model), build_char_tokenizer(str(text_model), ALPHABET, chat=True), hidden_size=16,
                     num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    with pytest.raises(ConfigError, match=r"row 0 field 'prompt' has image / video / audio message parts, but "
                                          r"model.path=.* is a text-only model \(qwen2\)"):
        validate_chat_template_present(load_config(None, [f"model.path={text_model}", f"data.train_path={path}"]))
    for extra, message in (("rollout.placement=async", "rollout.placement=async does not carry media prompts yet"),
                           ("env.name=tools", "env.name with media prompts is not supported yet")):
        with pytest.raises(ConfigError, match=rf"row 0 field 'prompt' has image / video / audio message parts; {message}"):
            validate_chat_template_present(load_config(None, [f"model.path={vl_dir}", f"data.train_path={path}", extra]))
    with pytest.raises(ConfigError, match=r"which take their media as content parts .*not data.image_field"):
        validate_chat_template_present(load_config(None, [f"model.path={vl_dir}", f"data.train_path={path}",
                                                          "data.image_field=image"]))
