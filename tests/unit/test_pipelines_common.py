"""pipelines/common.py: the jsonl and media-split writers the demo pipelines share, read back with the runtime's
reader, and the answer warm-up's loss against an independent computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.common import answer_warmup, media_prompt_inputs, write_jsonl, write_media_split
from streamrft.data import read_rows


def test_write_jsonl_creates_the_folder_and_the_runtime_reader_reads_the_rows_back(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "347*29"}], "reference": "10063"}, {"prompt": "é", "x": [1, 2]}]
    path = write_jsonl(tmp_path / "a" / "b" / "rows.jsonl", iter(rows))
    assert path == str(tmp_path / "a" / "b" / "rows.jsonl")
    assert read_rows(path) == rows
    assert write_jsonl(path, []) == path and read_rows(path) == []  # rewritten, not appended


def test_write_media_split_saves_each_example_and_points_its_row_at_the_absolute_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = []

    def save(media: bytes, file) -> None:
        saved.append(file)
        file.write_bytes(media)

    path = write_media_split("out", "eval", [(b"one", "1"), (b"two", "2")], "how many?", field="blob",
                             folder="blobs", suffix=".bin", save=save)
    assert path == "out/eval.jsonl"
    rows = read_rows(path)
    assert [r["reference"] for r in rows] == ["1", "2"] and {r["prompt"] for r in rows} == {"how many?"}
    assert [r["blob"] for r in rows] == [str(tmp_path / "out" / "blobs" / "eval" / f"0000{i}.bin") for i in (0, 1)]
    assert [open(r["blob"], "rb").read() for r in rows] == [b"one", b"two"]
    assert len(saved) == 2


def test_visual_count_rows_point_at_pngs_showing_the_reference_count(tmp_path):
    from pipelines.visual_count.task import CELL, write_split

    rows = read_rows(write_split(str(tmp_path), "train", 6, seed=3))
    assert len(rows) == 6
    for row in rows:
        img = np.asarray(Image.open(row["image"]).convert("L"))
        # count the white squares independently: one per 8x8 cell whose centre pixel is lit
        lit = sum(img[y * CELL + CELL // 2, x * CELL + CELL // 2] > 128 for y in range(4) for x in range(4))
        assert str(lit) == row["reference"], row


def test_audio_qa_rows_point_at_wavs_whose_pitch_gives_the_reference_letter(tmp_path):
    import soundfile as sf

    from pipelines.audio_qa.task import PROMPT, RATE, write_split

    rows = read_rows(write_split(str(tmp_path), "eval", 8, seed=7))
    assert {r["prompt"] for r in rows} == {PROMPT} and {r["reference"] for r in rows} == {"a", "b"}
    for row in rows:
        wave, rate = sf.read(row["audio"], dtype="float32")
        assert rate == RATE and wave.shape == (RATE // 2,)
        peak_hz = np.argmax(np.abs(np.fft.rfft(wave))) * rate / len(wave)
        assert row["reference"] == ("a" if peak_hz > 750 else "b"), (row, peak_hz)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from pipelines.visual_count.task import ALPHABET
    from streamrft.models.multimodal import load_multimodal_policy
    from streamrft.models.vl import build_tiny_qwen2_vl

    out = tmp_path_factory.mktemp("vl")
    build_tiny_qwen2_vl(str(out), ALPHABET, hidden_size=32, num_layers=1)
    return load_multimodal_policy(str(out))[:2]


def test_answer_warmup_returns_the_mean_answer_nll_and_lowers_it(tiny_vl):
    from pipelines.visual_count.task import PROMPT, make_examples

    model, processor = tiny_vl
    examples = make_examples(4, seed=0)
    inputs = media_prompt_inputs(processor, PROMPT, "images", examples)
    answers = [a for _, a in examples]
    tok = processor.tokenizer

    # independent: the whole prompt + answer + eos through the model, log-softmax at the answer positions
    expected = []
    for x, answer in zip(inputs, answers):
        target = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.cat([x["input_ids"], torch.tensor([target])], dim=1)
        extra = {k: v for k, v in x.items() if k not in ("input_ids", "attention_mask")}
        for k, v in extra.items():  # per-token fields (mm_token_type_ids): the answer's tokens are text, 0
            if torch.is_tensor(v) and v.shape == x["input_ids"].shape:
                extra[k] = torch.cat([v, torch.zeros(1, len(target), dtype=v.dtype)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]
        n = x["input_ids"].shape[1]
        logp = torch.log_softmax(logits[n - 1:-1].float(), -1)
        expected += [-logp[i, t].item() for i, t in enumerate(target)]
    state = {k: v.clone() for k, v in model.state_dict().items()}

    # lr 0: the model is unchanged, so the loss is the one computed above
    first = answer_warmup(model, processor, 1, lambda step: (inputs, answers), lr=0.0)
    assert first.item() == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    last = answer_warmup(model, processor, 15, lambda step: (inputs, answers), lr=3e-3)
    assert last.item() < 0.8 * first.item()
    assert math.isnan(answer_warmup(model, processor, 0, lambda step: (inputs, answers), lr=0.0).item())
    model.load_state_dict(state)
