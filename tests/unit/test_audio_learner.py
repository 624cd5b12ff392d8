"""The learner's log-probs with audio (Qwen2-Audio): its recompute of engine samples equals the engine's
behaviour log-probs, right-padded and packed, and clips that do not belong to a microbatch are an error."""

import asyncio

import numpy as np
import pytest
import torch

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from streamrft.learner.logprobs import token_logprobs
from streamrft.learner.microbatch import SequenceSample, make_microbatches
from streamrft.learner.packing import make_packed_microbatches, rows_by_sample
from streamrft.models.audio import build_tiny_qwen2_audio
from streamrft.models.media_inputs import media_tensors
from streamrft.models.multimodal import build_model_inputs, load_multimodal_policy

ALPHABET = "abcdefghijklmnopqrstuvwxyz ?"


def _tone(hz, seconds):
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(int(seconds * 16000)) / 16000)).astype(np.float32)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Three prompts whose clips differ in length (different placeholder counts), 2 sampled responses each."""
    path = build_tiny_qwen2_audio(str(tmp_path_factory.mktemp("au")), ALPHABET, num_layers=2)
    model, processor, _ = load_multimodal_policy(path)
    prompts = [("which?", _tone(300, 0.3)), ("is it high or low?", _tone(1200, 0.9)), ("hm", _tone(700, 0.55))]
    inputs = [build_model_inputs(processor, p, {"audios": [w]}) for p, w in prompts]
    reqs, mm = [], {}
    for i, x in enumerate(inputs):
        for j in range(2):
            reqs.append(GenerationRequest(f"p{i}s{j}", x["input_ids"][0].tolist(), seed=10 * i + j))
            mm[f"p{i}s{j}"] = x
    engine = HFEngine(model, EngineConfig(max_new_tokens=5, temperature=0.8), [], processor.tokenizer.pad_token_id,
                      torch.device("cpu"))
    samples = sorted(asyncio.run(engine.generate_all(reqs, mm)), key=lambda s: s.request_id)
    seqs = [SequenceSample(prompt_ids=mm[s.request_id]["input_ids"][0], response_ids=s.response_ids,
                           tensors={"behaviour_logprobs": torch.tensor(s.logprobs)}) for s in samples]
    per_sample = [media_tensors(mm[s.request_id]) for s in samples]
    return model, seqs, per_sample


def _with_media(mb, per_sample):
    """What ActorUpdate._attach_media does: the rows' clips concatenated in sample_index order."""
    rows = [per_sample[i] for i in mb["sample_index"].tolist()]
    return {**mb, **{k: torch.cat([r[k] for r in rows]) for k in rows[0]}}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_learner_logprobs_with_audio_equal_the_engine_behaviour_logprobs(generated, packed):
    model, seqs, per_sample = generated
    make = make_packed_microbatches if packed else make_microbatches
    mbs = make(seqs, 120)  # several samples per microbatch (packed: several per row)
    assert max(len(mb["sample_index"]) for mb in mbs) >= 2
    seen = 0
    with torch.no_grad():
        for mb in mbs:
            logp_BL, _ = token_logprobs(model, _with_media(mb, per_sample), temperature=0.8, with_entropy=False)
            mb["logp"] = logp_BL
            for i, row in rows_by_sample(mb, "logp").items():
                torch.testing.assert_close(row, seqs[i].tensors["behaviour_logprobs"], atol=1e-4, rtol=0)
                seen += 1
    assert seen == len(seqs)


def test_learner_logprobs_without_the_audio_differ_and_a_missing_clip_is_an_error(generated):
    model, seqs, per_sample = generated
    mb = make_microbatches(seqs[:2], 10_000)[0]  # two samples of the same prompt
    with torch.no_grad():
        text_only, _ = token_logprobs(model, mb, temperature=0.8, with_entropy=False)
        with_audio, _ = token_logprobs(model, _with_media(mb, per_sample), temperature=0.8, with_entropy=False)
        # the clip matters: dropping it (placeholders as plain tokens) moves the log-probs
        assert (text_only - with_audio).abs().max() > 1e-3
        one_clip = {**mb, **per_sample[0]}  # two rows with placeholders, one clip
        with pytest.raises(ValueError, match=r"has \d+ <\|AUDIO\|> placeholders but its 1 clips give \d+ audio features"):
            token_logprobs(model, one_clip, temperature=0.8, with_entropy=False)


def test_a_microbatch_without_clips_still_gives_the_audio_tower_a_zero_gradient(generated):
    """A padding microbatch (a rank with fewer samples) on an audio model: every trainable tower and projector
    weight gets a gradient of 0, as on ranks whose microbatches had clips (FSDP2 reduce-scatters only the
    parameters with a gradient; ranks must agree on them)."""
    from streamrft.learner.microbatch import padding_microbatch

    model, _, _ = generated
    model.zero_grad(set_to_none=True)
    logp_BL, _ = token_logprobs(model, padding_microbatch(["behaviour_logprobs"]), temperature=1.0, with_entropy=False)
    logp_BL.sum().backward()
    tower = [(n, p) for n, p in model.named_parameters()
             if n.startswith(("model.audio_tower.", "model.multi_modal_projector.")) and p.requires_grad]
    assert tower and all(p.grad is not None and not p.grad.any() for _, p in tower), [n for n, p in tower if p.grad is None]
    model.zero_grad(set_to_none=True)
