import asyncio
import time

import pytest
import torch

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy

torch.set_num_threads(1)
EOS = 1
PAD = 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    tok = build_char_tokenizer(out, "0123456789+-= ")
    build_tiny_qwen2(out, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    module, _ = load_policy(out)
    # Larger random weights than the default init, so greedy and sampled outputs vary from step to step.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    module.eval()
    return module


def _engine(model, **kw):
    return HFEngine(model, EngineConfig(**kw), eos_token_ids=[EOS], pad_token_id=PAD, device=torch.device("cpu"))


PROMPTS = [[4, 5, 13, 6, 15], [7, 8, 9, 3, 4, 16, 13, 16, 12, 11, 15], [10], [5, 5, 5, 14, 3, 15]]


def _requests(prompts=PROMPTS, seeds=None, max_new=None):
    seeds = seeds or list(range(len(prompts)))
    return [GenerationRequest(f"r{i}", p, seed=s, max_new_tokens=max_new) for i, (p, s) in enumerate(zip(prompts, seeds))]


def _full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_greedy_equals_an_uncached_argmax_loop_for_each_prompt_alone(model):
    engine = _engine(model, top_k=1, max_new_tokens=12, max_batch_size=3)  # 4 prompts: two chunks
    samples = asyncio.run(engine.generate_all(_requests()))
    for prompt, sample in zip(PROMPTS, samples):
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(_full_logits(model, ids)[-1].argmax()))
            if ids[-1] == EOS:
                break
        assert sample.response_ids == ids[len(prompt):]
        assert sample.finish_reason == ("stop" if ids[-1] == EOS else "length")
        assert sample.logprobs == [0.0] * len(sample.response_ids)  # top-1 leaves one token
    assert len({tuple(s.response_ids) for s in samples}) > 1


@pytest.mark.parametrize("temperature,first_token_temperature", [(0.7, 0.0), (1.3, 2.5)])
def test_logprobs_equal_a_full_forward_recomputation_at_the_sampling_temperature(
    model, temperature, first_token_temperature
):
    engine = _engine(model, temperature=temperature, first_token_temperature=first_token_temperature,
                     max_new_tokens=10)
    samples = asyncio.run(engine.generate_all(_requests()))
    for prompt, sample in zip(PROMPTS, samples):
        assert len(sample.logprobs) == len(sample.response_ids)
        logits_TV = _full_logits(model, prompt + sample.response_ids)
        for j, token in enumerate(sample.response_ids):
            t = first_token_temperature if (j == 0 and first_token_temperature > 0) else temperature
            expected = torch.log_softmax(logits_TV[len(prompt) - 1 + j] / t, dim=-1)[token].item()
            assert sample.logprobs[j] == pytest.approx(expected, abs=1e-5)


def test_the_same_seed_gives_the_same_sample_whatever_the_batch_composition(model):
    target = GenerationRequest("target", PROMPTS[0], seed=1234, max_new_tokens=10)
    alone = asyncio.run(_engine(model, max_new_tokens=10).generate_all([target]))[0]
    others = _requests(seeds=[11, 12, 13, 14])
    mixed = [others[1], others[2], target, others[0], others[3]]  # longer prompts: target is left-padded
    for batch_size in (5, 2):
        got = asyncio.run(_engine(model, max_new_tokens=10, max_batch_size=batch_size).generate_all(mixed))
        assert got[2].response_ids == alone.response_ids
        assert got[2].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # and a different seed gives a different sample
    other = GenerationRequest("x", PROMPTS[0], seed=999, max_new_tokens=10)
    assert asyncio.run(_engine(model, max_new_tokens=10).generate_all([other]))[0].response_ids != alone.response_ids


def test_a_stop_token_ends_the_sample_and_is_kept_as_its_last_token(model):
    reqs = _requests(max_new=12)
    free = asyncio.run(_engine(model, temperature=1.5, max_new_tokens=12).generate_all(reqs))
    ref = next(s for s in free if len(s.response_ids) >= 4 and EOS not in s.response_ids)
    stop = ref.response_ids[3]
    stopped = asyncio.run(
        _engine(model, temperature=1.5, max_new_tokens=12, stop_token_ids=[stop]).generate_all(reqs))
    for before, after in zip(free, stopped):
        hits = [j for j, t in enumerate(before.response_ids) if t in (stop, EOS)]
        if hits:
            assert after.response_ids == before.response_ids[: hits[0] + 1]
            assert after.finish_reason == "stop"
        else:
            assert after.response_ids == before.response_ids
            assert after.finish_reason == "length" and len(after.response_ids) == 12
        assert after.logprobs == pytest.approx(before.logprobs[: len(after.response_ids)], abs=1e-5)


def test_a_short_sample_is_yielded_before_a_long_one_ends_and_the_loop_keeps_running(model):
    engine = _engine(model, temperature=1.0, max_new_tokens=40, stop_token_ids=[])
    engine.stop_token_ids = frozenset()  # no EOS either: lengths are exactly max_new_tokens
    reqs = [GenerationRequest("long", PROMPTS[1], seed=1, max_new_tokens=40),
            GenerationRequest("short", PROMPTS[0], seed=2, max_new_tokens=2)]
    ticks = 0

    async def ticker(stop):
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(ticker(stop))
        events = []
        async for s in engine.generate(reqs):
            events.append((s.request_id, len(s.response_ids), s.finish_reason, ticks, time.perf_counter(), s.seconds))
        stop.set()
        await task
        return events

    events = asyncio.run(main())
    assert [e[:3] for e in events] == [("short", 2, "length"), ("long", 40, "length")]
    assert events[0][3] > 0 and events[1][3] > events[0][3] + 10  # the ticker ran during decoding
    assert 0 < events[0][5] < events[1][5]


def test_generation_restores_train_mode_and_stamps_the_policy_version(model):
    model.train()
    engine = HFEngine(model, EngineConfig(top_k=1, max_new_tokens=3), [EOS], PAD, torch.device("cpu"), policy_version=7)
    seen_training = []

    async def main():
        async for s in engine.generate(_requests()[:2]):
            seen_training.append(model.training)
            assert s.policy_version == 7

    asyncio.run(main())
    assert seen_training == [False, False] and model.training
    model.eval()


def test_update_weights_copies_tensors_by_name_and_sets_the_version(model, tmp_path):
    tok = build_char_tokenizer(str(tmp_path), "0123456789+-= ")
    build_tiny_qwen2(str(tmp_path), tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=64, seed=5)
    copy, _ = load_policy(str(tmp_path))
    engine = HFEngine(copy, EngineConfig(top_k=1, max_new_tokens=8), [EOS], PAD, torch.device("cpu"))
    asyncio.run(engine.update_weights(list(model.state_dict().items()), version=3))
    assert engine.policy_version == 3
    for name, value in model.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value)
    ref = asyncio.run(_engine(model, top_k=1, max_new_tokens=8).generate_all(_requests()))
    got = asyncio.run(engine.generate_all(_requests()))
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]
    with pytest.raises(ValueError, match="no parameter named 'nope'"):
        asyncio.run(engine.update_weights([("nope", torch.zeros(1))], version=4))
    asyncio.run(engine.update_weights([], version=5))  # colocated: version bump only
    assert engine.policy_version == 5


def test_sleep_then_wake_round_trips_and_generate_while_asleep_fails(model):
    engine = _engine(model, top_k=1, max_new_tokens=4)
    before = asyncio.run(engine.generate_all(_requests()))
    asyncio.run(engine.sleep(2))

    async def consume():
        return [s async for s in engine.generate(_requests())]

    with pytest.raises(RuntimeError, match="asleep"):
        asyncio.run(consume())
    asyncio.run(engine.wake())
    after = asyncio.run(engine.generate_all(_requests()))
    assert [s.response_ids for s in after] == [s.response_ids for s in before]


def test_sleep_level_1_keeps_the_allocator_cache_for_the_learner_and_level_2_returns_it(model, monkeypatch):
    """Level 1 leaves the cached device memory to this process's learner (colocated: one allocator serves
    both); level 2 hands it to the driver, for other processes on the device."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    engine = _engine(model, max_new_tokens=4)
    asyncio.run(engine.sleep(1))
    assert emptied == []
    asyncio.run(engine.wake())
    asyncio.run(engine.sleep(2))
    assert emptied == [1]


def test_bad_settings_and_requests_raise_value_errors_naming_the_fix(model):
    with pytest.raises(ValueError, match="engine.temperature"):
        _engine(model, temperature=0.0)
    engine = _engine(model, max_new_tokens=4)
    too_long = [GenerationRequest("big", [4] * 120, seed=0, max_new_tokens=20)]
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        asyncio.run(engine.generate_all(too_long))
    with pytest.raises(ValueError, match="empty prompt"):
        asyncio.run(engine.generate_all([GenerationRequest("e", [], seed=0)]))


def test_build_engine_picks_the_hf_engine_by_name_with_the_tokenizers_eos_and_pad(model, tmp_path):
    from streamrft.engines import ENGINES, build_engine

    tok = build_char_tokenizer(str(tmp_path), "0123456789+-= ")
    engine = build_engine(EngineConfig(type="hf", stop_token_ids=[5]), model, tok, torch.device("cpu"))
    assert isinstance(engine, HFEngine) and set(ENGINES) == {"hf", "vllm", "sglang"}
    assert engine.stop_token_ids == {EOS, 5} and engine.pad_token_id == PAD
    with pytest.raises(ValueError, match="engine.type=vllm in process needs the model directory"):
        build_engine(EngineConfig(type="vllm"), model, tok, torch.device("cpu"))
