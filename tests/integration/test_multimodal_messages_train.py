"""A training run on message prompts with image parts (Qwen2-VL format), no data.image_field: the Generator renders
them with the processor's chat template, the hf engine generates with the pixels, the learner re-builds the same
prompt ids from the refs (it raises if they differ), held-out evaluation takes the same path. Every trajectory's
prompt ids equal those of the same row given as text with data.image_field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from streamrft.config import load_config
from streamrft.data import PromptDataset
from streamrft.models.media_inputs import MediaCodec, load_processor
from tests.integration.conftest import REPO

pytestmark = pytest.mark.slow
ALPHABET = "0123456789 ?howmany:"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}:{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}<|im_end|>"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


def test_image_message_parts_train_two_steps_with_the_field_rows_prompt_ids(tmp_path):
    import random

    from pipelines.visual_count.task import make_image
    from streamrft.compose import train
    from streamrft.models.vl import build_tiny_qwen2_vl

    model = build_tiny_qwen2_vl(str(tmp_path / "vl"), ALPHABET, hidden_size=32, num_layers=1)
    processor = load_processor(model)
    processor.chat_template = TEMPLATE  # as Qwen2-VL-Instruct ships chat_template.json
    processor.save_pretrained(model)
    rng, rows, field_rows = random.Random(0), [], []
    for i in range(8):
        count = rng.randint(1, 4)
        path = tmp_path / f"{i}.png"
        make_image(count, rng).save(path)
        messages = [{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                 {"type": "text", "text": "how many?"}]}]
        rows.append({"prompt": messages, "reference": str(count)})
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        field_rows.append({"prompt": text, "reference": str(count), "image": str(path)})
    for name, data in (("train", rows), ("fields", field_rows)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    out = tmp_path / "run"
    cfg = load_config(REPO / "pipelines" / "visual_count" / "config.yaml", [
        f"model.path={model}", f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'train.jsonl'}", "data.image_field=", "data.eval_size=4", f"output_dir={out}",
        "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2", "rollout.stage_timeout_s=120",
        "train.max_steps=2", f"sinks.jsonl={tmp_path / 'traj'}"])
    summary = train(cfg)
    assert summary["samples_trained"] == 2 * 4 * 2
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert any("heldout_n" in s or "heldout/n" in s for s in steps), steps[-1].keys()
    # the same rows as text + data.image_field: the ids the trajectories must carry
    fields = PromptDataset(tmp_path / "fields.jsonl")
    codec = MediaCodec.from_config(processor, SimpleNamespace(image_field="image", video_field="", audio_field="",
                                                              max_video_frames=0, video_fps=0.0))
    expected = {}
    for row in fields:
        text, _, inputs = codec.prompt(row, tmp_path / "fields.jsonl", "prompt")
        expected[text] = inputs["input_ids"][0].tolist()
    records = [json.loads(line) for f in sorted((tmp_path / "traj").glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len(records) == 2 * 4 * 2
    for rec in records:
        assert rec["prompt_ids"] == expected[rec["prompt"]]  # KeyError: a prompt that is not a rendered row
        assert rec["prompt"].startswith("<|im_start|>user:<|vision_start|><|image_pad|><|vision_end|>how many?")
