"""Tiny Qwen2-VL: processor round trip, log-prob wrapper vs a direct forward, freezing, engine generation."""

import asyncio

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from streamrft.models.multimodal import (
    build_model_inputs,
    check_packing,
    collate_prompts,
    freeze_prefix,
    load_multimodal_policy,
    response_logprobs,
    response_logprobs_batch,
    supports_packing,
)
from streamrft.models.vl import build_tiny_qwen2_vl, register_processors

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 ?"


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = build_tiny_qwen2_vl(str(tmp_path_factory.mktemp("vl")), ALPHABET, num_layers=2)
    model, processor, kind = load_multimodal_policy(path)
    assert kind == "vl"
    return path, model, processor


def _img(h, w, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _direct_logp(model, inputs, resp, temperature):
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([resp])], 1)
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    full["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(resp), dtype=torch.long)], 1)
    model.model.rope_deltas = None
    logits = model(**full).logits[0, -len(resp) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]


def test_the_saved_processor_loads_back_with_autoprocessor_and_processes_identically(vl):
    path, _, processor = vl
    register_processors()
    again = AutoProcessor.from_pretrained(path)
    a = build_model_inputs(processor, "how many?", {"images": [_img(20, 28, 0)]})
    b = build_model_inputs(again, "how many?", {"images": [_img(20, 28, 0)]})
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert int((a["input_ids"] == processor.image_token_id).sum()) == int(a["image_grid_thw"].prod()) // 4


@pytest.mark.parametrize("media", ["image", "video", "both"])
def test_response_logprobs_equal_a_direct_forward_of_the_model(vl, media):
    _, model, processor = vl
    m = {"image": {"images": [_img(24, 40, 1)]}, "video": {"videos": [[_img(16, 16, i) for i in range(3)]]},
         "both": {"images": [_img(24, 40, 1)], "videos": [[_img(16, 16, i) for i in range(4)]]}}[media]
    inputs = build_model_inputs(processor, "count ?", m)
    resp = [5, 9, 11, 1]
    with torch.no_grad():
        got = response_logprobs(model, inputs, resp, temperature=0.7)
        want = _direct_logp(model, inputs, resp, 0.7)
    assert got.shape == (4,)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_batched_logprobs_with_left_padding_match_each_prompt_alone(vl):
    _, model, processor = vl
    a = build_model_inputs(processor, "a?", {"images": [_img(32, 32, 2)]})
    b = build_model_inputs(processor, "longer prompt?", {"images": [_img(16, 24, 3)]})
    batch = collate_prompts([a, b], pad_token_id=0)
    with torch.no_grad():
        logp_BT, mask_BT = response_logprobs_batch(model, batch, [[4, 5, 6], [7, 1]])
        alone = [response_logprobs(model, a, [4, 5, 6]), response_logprobs(model, b, [7, 1])]
    torch.testing.assert_close(logp_BT[0], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logp_BT[1, :2], alone[1], atol=1e-5, rtol=0)
    assert mask_BT.tolist() == [[1, 1, 1], [1, 1, 0]]


def test_freeze_prefix_freezes_the_vision_tower_only_and_rejects_unknown_prefixes(vl):
    path, _, _ = vl
    model, _, _ = load_multimodal_policy(path)
    n = freeze_prefix(model, ["model.visual."])
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert n == len(frozen) > 0 and all(name.startswith("model.visual.") for name in frozen)
    with pytest.raises(ValueError, match=r"model.freeze_prefix entry 'vision.' matches no parameter of "
                                         r"Qwen2VLForConditionalGeneration"):
        freeze_prefix(model, ["vision."])


def test_vl_models_refuse_sample_packing(vl):
    _, model, _ = vl
    assert not supports_packing(model)
    with pytest.raises(ValueError, match="sample packing is not supported for Qwen2VLForConditionalGeneration"):
        check_packing(model, True)


def test_engine_greedy_generation_matches_full_recomputation_with_mrope(vl):
    _, model, processor = vl
    prompts = [("how many?", [_img(32, 32, 5)]), ("a?", [_img(16, 40, 6)])]
    inputs = {f"r{i}": build_model_inputs(processor, p, {"images": imgs}) for i, (p, imgs) in enumerate(prompts)}
    reqs = [GenerationRequest(f"r{i}", inputs[f"r{i}"]["input_ids"][0].tolist(), seed=i) for i in range(2)]
    engine = HFEngine(model, EngineConfig(top_k=1, max_new_tokens=5), [], 0, torch.device("cpu"))
    samples = asyncio.run(engine.generate_all(reqs, inputs))
    for s in samples:
        ids = []
        with torch.no_grad():
            for _ in range(5):  # greedy by recomputing the whole sequence each step (no KV cache)
                x = dict(inputs[s.request_id])
                full = torch.cat([x["input_ids"], torch.tensor([ids], dtype=torch.long)], 1)
                x.update(input_ids=full, attention_mask=torch.ones_like(full),
                         mm_token_type_ids=torch.cat([x["mm_token_type_ids"], torch.zeros(1, len(ids), dtype=torch.long)], 1))
                model.model.rope_deltas = None
                logits = model(**x).logits[0, -1]
                logits[[processor.image_token_id, processor.video_token_id]] = float("-inf")  # never sampled
                ids.append(int(logits.argmax()))
            logp = response_logprobs(model, inputs[s.request_id], s.response_ids)
        assert s.response_ids == ids
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.zeros(5), atol=1e-5, rtol=0)  # top_k=1
        assert logp.shape == (5,)
