"""In-flight weight updates in the hf engine (``own_weights=True``, the async placement's engine).

A new version lands while ``generate()`` runs: no row is dropped, every token records the version that
sampled it, and every token's behaviour log-prob equals a full forward recomputation under that version
(the engine re-prefills its rows after the switch). Two real, different weight sets of one tiny Qwen2.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy

torch.set_num_threads(1)
PAD = 0
TEMPERATURE = 0.8
PROMPTS = [[4, 5, 13, 6, 15], [7, 8, 9, 3, 4, 16, 13, 16, 12, 11, 15], [10], [5, 5, 5, 14, 3, 15]]
MAX_NEW = [3, 10, 14, 6]  # row 0 ends first; the update lands when it is yielded


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Large random matrices, so the two versions' distributions differ visibly."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module.eval()


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[int, torch.nn.Module]:
    out = str(tmp_path_factory.mktemp("tiny"))
    tok = build_char_tokenizer(out, "0123456789+-= ")
    build_tiny_qwen2(out, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    base, _ = load_policy(out)
    return {0: _randomized(copy.deepcopy(base), 0), 1: _randomized(copy.deepcopy(base), 1)}


def _engine(versions, own_weights: bool = True, **kw) -> HFEngine:
    cfg = EngineConfig(temperature=TEMPERATURE, ignore_eos=True, **kw)  # lengths fixed by max_new_tokens
    return HFEngine(copy.deepcopy(versions[0]), cfg, eos_token_ids=[1], pad_token_id=PAD,
                    device=torch.device("cpu"), own_weights=own_weights)


def _requests(max_new=MAX_NEW) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, seed=100 + i, max_new_tokens=n)
            for i, (p, n) in enumerate(zip(PROMPTS, max_new))]


def _state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone()) for n, t in module.state_dict().items()]


def _recomputed(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log softmax(logits / T)[token] of every response token, one full forward without a cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1].double()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp[torch.arange(len(response)), torch.tensor(response)]


def _check_logprobs(versions, prompts, samples, atol=1e-5) -> None:
    """Each token's behaviour log-prob against a recomputation under its own version; also checks that the
    other version would give a different number (else the comparison would prove nothing)."""
    for prompt, s in zip(prompts, samples):
        assert len(s.token_versions) == len(s.response_ids) == len(s.logprobs)
        for v in set(s.token_versions):
            idx = [i for i, tv in enumerate(s.token_versions) if tv == v]
            own = _recomputed(versions[v], prompt, s.response_ids)[idx]
            other = _recomputed(versions[1 - v], prompt, s.response_ids)[idx]
            got = torch.tensor(s.logprobs, dtype=torch.float64)[idx]
            assert torch.allclose(got, own, atol=atol, rtol=0), (s.request_id, v, (got - own).abs().max())
            assert (got - other).abs().max() > 1e-2, (s.request_id, v)


def test_update_mid_generation_rows_carry_two_versions_and_each_token_matches_its_version(versions):
    engine = _engine(versions)
    new = _state(versions[1])

    async def run():
        samples = []
        async for s in engine.generate(_requests()):
            samples.append(s)
            if len(samples) == 1:  # row 0 finished after 3 steps; rows 1-3 are mid-generation
                await engine.update_weights(new, 1)
                assert engine.policy_version == 1 and engine.pending_version is None
                await engine.wait_version(1, timeout_s=1)
        return samples

    samples = {s.request_id: s for s in asyncio.run(run())}
    assert set(samples) == {"r0", "r1", "r2", "r3"}  # nothing dropped
    assert samples["r0"].token_versions == [0, 0, 0]
    for i, n in enumerate(MAX_NEW[1:], start=1):  # 3 tokens under version 0, the rest under version 1
        s = samples[f"r{i}"]
        assert len(s.response_ids) == n and s.finish_reason == "length"
        assert s.token_versions == [0] * 3 + [1] * (n - 3)
        assert s.policy_version == 0  # the version the row started under
    _check_logprobs(versions, PROMPTS, [samples[f"r{i}"] for i in range(4)])
    assert engine.reprefills == 1


def test_without_an_update_the_rows_match_version_0_and_a_fresh_engine_on_version_1_matches_version_1(versions):
    """The two endpoints of the mixed run: one version per row, log-probs of that version."""
    for v in (0, 1):
        engine = _engine(versions)
        if v:
            asyncio.run(engine.update_weights(_state(versions[1]), 1))
        samples = asyncio.run(engine.generate_all(_requests()))
        assert all(s.token_versions == [v] * len(s.response_ids) for s in samples)
        _check_logprobs(versions, PROMPTS, samples)
        assert engine.reprefills == 0


def test_update_from_another_thread_waits_for_the_running_forward_and_chunks_after_it_use_the_new_version(versions):
    engine = _engine(versions, max_batch_size=2)  # two chunks: r0, r1 then r2, r3
    in_forward, release = threading.Event(), threading.Event()
    seen_during_forward: list[int] = []
    calls = 0

    def slow_fourth_forward(module, args, kwargs):
        nonlocal calls
        calls += 1
        if calls == 4:  # the 4th forward of chunk 1 (token index 3 of r1): the update must wait for it
            in_forward.set()
            release.wait(5)
            time.sleep(0.2)
            seen_during_forward.append(engine.policy_version)

    handle = engine.module.register_forward_pre_hook(slow_fourth_forward, with_kwargs=True)
    errors: list[BaseException] = []

    def updater():
        try:
            assert in_forward.wait(10)
            release.set()
            asyncio.run(engine.update_weights(_state(versions[1]), 1))  # its own event loop
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=updater)
    thread.start()
    try:
        samples = asyncio.run(engine.generate_all(_requests()))
    finally:
        thread.join(10)
        handle.remove()
    assert not errors, errors
    assert seen_during_forward == [0]  # the version did not change under the running forward
    assert engine.policy_version == 1
    r0, r1, r2, r3 = samples
    assert r0.token_versions == [0, 0, 0]  # r0 ended with forward 3
    k = r1.token_versions.count(0)  # the switch lands after forward 4 (or, if the loop won the lock, later)
    assert k >= 4 and r1.token_versions == [0] * k + [1] * (10 - k) and k < 10
    assert r2.token_versions == [1] * 14 and r3.token_versions == [1] * 6  # chunk 2 started after the switch
    _check_logprobs(versions, PROMPTS, samples)


def test_static_cache_pins_the_weights_a_mid_chunk_update_is_staged_until_the_chunk_ends(versions):
    engine = _engine(versions, static_cache=True, decode_kernels="torch", sync_every=2, max_batch_size=2)
    # chunks run in the engine's own task (engines/call_merge.py), not paced by the caller: chunk 1 (r0, r1)
    # waits after r0 until the update is staged, so the update lands while it is surely still decoding r1
    staged = threading.Event()
    run_chunk = engine._static_chunk

    async def held_after_r0(requests, start):
        async for sample in run_chunk(requests, start):
            yield sample
            if sample.request_id == "r0":
                await asyncio.to_thread(staged.wait, 10)

    engine._static_chunk = held_after_r0

    async def run():
        samples, states = [], []
        async for s in engine.generate(_requests()):
            samples.append(s)
            if len(samples) == 1:
                await engine.update_weights(_state(versions[1]), 1)
                states.append((engine.policy_version, engine.pending_version))
                with pytest.raises(TimeoutError, match="not loaded after 0.05s .*version 1 staged behind 1 pinned"):
                    await engine.wait_version(1, timeout_s=0.05)
                staged.set()
        return samples, states

    samples, states = asyncio.run(run())
    assert states == [(0, 1)]  # staged, not loaded: the chunk's concatenated weights stay consistent
    assert engine.policy_version == 1 and engine.pending_version is None
    by_id = {s.request_id: s for s in samples}
    assert by_id["r0"].token_versions == [0] * 3 and by_id["r1"].token_versions == [0] * 10
    assert by_id["r2"].token_versions == [1] * 14 and by_id["r3"].token_versions == [1] * 6
    assert by_id["r2"].policy_version == 1
    # the static path's kernels differ from the HF forward by float noise only
    _check_logprobs(versions, PROMPTS, [by_id[f"r{i}"] for i in range(4)], atol=1e-4)


def test_learner_module_engine_refuses_an_update_while_generating(versions):
    engine = _engine(versions, own_weights=False)

    async def run():
        async for _ in engine.generate(_requests()):
            with pytest.raises(RuntimeError) as info:
                await engine.update_weights(_state(versions[1]), 1)
            return str(info.value)

    message = asyncio.run(run())
    assert message == ("HFEngine.update_weights(version=1) called with 1 generate() calls in flight on the "
                       "learner's own module (own_weights=False): its weights may not change under them; finish "
                       "the rollout first, or give the engine a private copy with own_weights=True")
    assert engine.policy_version == 0
    assert torch.equal(engine.module.lm_head.weight, versions[0].lm_head.weight)  # nothing was copied


def test_version_rules(versions):
    engine = _engine(versions)
    new = _state(versions[1])

    async def run():
        await engine.update_weights(new[:3], 2)  # buckets of one version between generate() calls: fine
        await engine.update_weights(new[3:], 2)
        with pytest.raises(ValueError, match=r"version 1 is older than the engine's version 2"):
            await engine.update_weights(new, 1)
        stream = engine.generate(_requests())
        await anext(stream)
        with pytest.raises(ValueError, match="version 2 is already loaded and generate\\(\\) is running"):
            await engine.update_weights(new[:3], 2)
        await stream.aclose()
        with pytest.raises(ValueError, match="has no parameter named 'nope'"):
            await engine.update_weights([("nope", torch.zeros(1))], 3)
        with pytest.raises(TimeoutError, match="the weights of version 3 are not loaded after 0.01s"):
            await engine.wait_version(3, timeout_s=0.01)

    asyncio.run(run())
    assert engine.policy_version == 2
    assert all(torch.equal(t, dict(new)[n]) for n, t in engine.module.state_dict().items())


def test_multimodal_chunk_pins_the_weights_and_its_rows_finish_under_their_version(tmp_path):
    """Media prompts cannot be re-prefilled without encoding the media again: the update is staged until
    the chunk ends, and every token of the chunk carries the version it started under."""
    import numpy as np
    from PIL import Image

    from streamrft.models.multimodal import build_model_inputs, load_multimodal_policy
    from streamrft.models.vl import build_tiny_qwen2_vl

    model, processor, _ = load_multimodal_policy(build_tiny_qwen2_vl(str(tmp_path), "abc0123456789 ?", num_layers=1))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8))
    inputs = {"m0": build_model_inputs(processor, "a?", {"images": [image]})}
    requests = [GenerationRequest("m0", inputs["m0"]["input_ids"][0].tolist(), seed=0, max_new_tokens=2),
                GenerationRequest("t1", [5, 6, 7], seed=1, max_new_tokens=6)]
    new = [(n, t + 0.1) if t.is_floating_point() else (n, t) for n, t in model.state_dict().items()]
    engine = HFEngine(model.eval(), EngineConfig(ignore_eos=True), [], 0, torch.device("cpu"), own_weights=True)

    async def run():
        samples, states = [], []
        async for s in engine.generate(requests, inputs):
            samples.append(s)
            if len(samples) == 1:
                await engine.update_weights(new, 1)
                states.append((engine.policy_version, engine.pending_version))
        await engine.wait_version(1, timeout_s=1)
        return samples, states

    samples, states = asyncio.run(run())
    assert states == [(0, 1)]
    assert [s.token_versions for s in samples] == [[0, 0], [0] * 6]
    assert engine.policy_version == 1 and engine.pending_version is None and engine.reprefills == 0
    assert torch.equal(engine.module.state_dict()["lm_head.weight"], dict(new)["lm_head.weight"])
