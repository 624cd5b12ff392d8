"""Tiny Qwen2-Audio: processor round trip, log-prob wrapper vs a direct forward, freezing, engine generation."""

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoProcessor

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from streamrft.models.audio import build_tiny_qwen2_audio
from streamrft.models.multimodal import (
    build_model_inputs,
    collate_prompts,
    freeze_prefix,
    load_multimodal_policy,
    response_logprobs,
    response_logprobs_batch,
    supports_packing,
)

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 ?"


@pytest.fixture(scope="module")
def au(tmp_path_factory):
    path = build_tiny_qwen2_audio(str(tmp_path_factory.mktemp("au")), ALPHABET)
    model, processor, kind = load_multimodal_policy(path)
    assert kind == "audio"
    return path, model, processor


def _tone(hz, seconds=0.5, rate=16000):
    return np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate).astype(np.float32)


def test_the_saved_processor_loads_back_with_autoprocessor_and_processes_identically(au):
    path, _, processor = au
    again = AutoProcessor.from_pretrained(path)
    a = build_model_inputs(processor, "higher?", {"audios": [_tone(440)]})
    b = build_model_inputs(again, "higher?", {"audios": [_tone(440)]})
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    frames = int(a["feature_attention_mask"].sum())  # 0.5 s at 100 frames/s
    assert frames == 50 and int((a["input_ids"] == processor.audio_token_id).sum()) == ((frames - 1) // 2 + 1 - 2) // 2 + 1


def test_response_logprobs_equal_a_direct_forward_of_the_model(au):
    _, model, processor = au
    inputs = build_model_inputs(processor, "which?", {"audios": [_tone(300), _tone(600, 0.3)]})
    resp = [4, 8, 1]
    with torch.no_grad():
        got = response_logprobs(model, inputs, resp, temperature=1.3)
        full = dict(inputs)
        full["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([resp])], 1)
        full["attention_mask"] = torch.ones_like(full["input_ids"])
        want = torch.log_softmax(model(**full).logits[0, -4:-1] / 1.3, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_batched_audio_logprobs_match_each_prompt_alone(au):
    _, model, processor = au
    a = build_model_inputs(processor, "a?", {"audios": [_tone(300)]})
    b = build_model_inputs(processor, "longer one?", {"audios": [_tone(900, 0.2)]})
    with torch.no_grad():
        logp_BT, _ = response_logprobs_batch(model, collate_prompts([a, b], 0), [[4, 5], [6, 7]])
        torch.testing.assert_close(logp_BT[1], response_logprobs(model, b, [6, 7]), atol=1e-5, rtol=0)


def test_freeze_prefix_freezes_the_audio_tower_and_packing_stays_allowed(au):
    path, _, _ = au
    model, _, _ = load_multimodal_policy(path)
    freeze_prefix(model, ["model.audio_tower."])
    assert {n.split(".")[1] for n, p in model.named_parameters() if not p.requires_grad} == {"audio_tower"}
    assert supports_packing(model)


def test_a_clip_longer_than_the_feature_window_is_rejected(au):
    _, _, processor = au
    with pytest.raises(ValueError, match="audio clip 0 has 20000 samples, more than the feature extractor's window "
                                         "of 16000 \\(1 s\\); trim the clip"):
        build_model_inputs(processor, "x", {"audios": [np.zeros(20000, dtype=np.float32)]})


def test_engine_greedy_generation_with_audio_matches_the_wrapper(au):
    _, model, processor = au
    inputs = {"r0": build_model_inputs(processor, "hi?", {"audios": [_tone(500)]}),
              "r1": build_model_inputs(processor, "longer prompt?", {"audios": [_tone(200, 0.7)]})}
    reqs = [GenerationRequest(k, v["input_ids"][0].tolist(), seed=0) for k, v in inputs.items()]
    engine = HFEngine(model, EngineConfig(top_k=1, max_new_tokens=4), [], 0, torch.device("cpu"))
    samples = asyncio.run(engine.generate_all(reqs, inputs))
    with torch.no_grad():
        for s in samples:  # greedy: each token is the argmax of the recomputed distribution
            x = inputs[s.request_id]
            for t in range(4):
                full = dict(x)
                full["input_ids"] = torch.cat([x["input_ids"], torch.tensor([s.response_ids[:t]], dtype=torch.long)], 1)
                full["attention_mask"] = torch.ones_like(full["input_ids"])
                logits = model(**full).logits[0, -1]
                logits[processor.audio_token_id] = float("-inf")  # placeholders are never sampled
                assert int(logits.argmax()) == s.response_ids[t]
