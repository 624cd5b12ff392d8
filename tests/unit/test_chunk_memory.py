"""A static-cache chunk takes only the rows whose preallocated KV cache fits in the memory free
(engines/chunk_memory.py): the estimate against the bytes a real StaticDecoder allocates, the prefix search,
and the engine splitting a call (colocated) or capping a merged chunk (own weights) when the device is short.
The device's free memory is the one thing stood in for: this machine has no GPU."""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch

from streamrft.config.engine import EngineConfig
from streamrft.engines import chunk_memory, hf, hf_fast
from streamrft.engines.base import GenerationRequest
from streamrft.engines.call_merge import CallMerger
from streamrft.engines.chunk_memory import (
    MARGIN_BYTES, STEP_FIXED_BYTES, DecoderShape, chunk_bytes, row_bytes, rows_that_fit, step_bytes,
)
from streamrft.engines.hf import HFEngine

from tests.unit.test_call_merge import ScriptedChunks, _collect, _rows


def test_the_compaction_copy_is_the_fraction_at_which_chunks_compact():
    assert chunk_memory.COMPACTION_COPY == hf_fast.COMPACT_FRACTION


def test_the_estimate_bounds_what_a_real_static_decoder_allocates(tiny_policy):
    prompts = [[4, 5, 6]] * 3 + [[7, 8, 9, 10, 11]] * 2 + [[12]]  # three groups: three prompt entries
    n_new = 9
    dec = hf_fast.StaticDecoder(tiny_policy, prompts, list(range(6)), n_new, 0, [1], 1.0, 0.0, 0, 1.0,
                                torch.device("cpu"))
    cache = sum(t.nbytes for t in dec.prompt_k + dec.prompt_v + dec.gen_k + dec.gen_v)
    outputs = dec.tokens_BN.nbytes + dec.logp_BN.nbytes
    shape = hf_fast.decoder_shape(tiny_policy)
    assert shape == DecoderShape(n_layers=2, n_kv_heads=2, head_dim=8, vocab=tiny_policy.config.vocab_size,
                                 dtype_bytes=4, hidden=32, intermediate=64)
    # by hand: 3 entries of 5 slots and 6 rows of 8 generated slots, keys and values, 2 layers x 2 heads x 8 x 4 B
    slot = 2 * 2 * 2 * 8 * 4
    assert cache == slot * (3 * 5 + 6 * 8)
    estimate = chunk_bytes(shape, prompts, n_new)
    # the larger of one decode step's temporaries and the prefill's (3 entries x 5 tokens x (3 x 64 + 4 x 32) x 4 B)
    transient = max(step_bytes(shape.vocab, 6), 3 * 5 * (3 * 64 + 4 * 32) * 4 + STEP_FIXED_BYTES)
    assert estimate == slot * 3 * 5 + 6 * (int(slot * 8 * 1.25) + 12 * n_new) + transient
    assert estimate - transient >= cache + outputs


def test_rows_that_fit_is_the_longest_prefix_within_the_free_bytes_less_the_margin():
    shape = DecoderShape(n_layers=24, n_kv_heads=2, head_dim=64, vocab=151936, dtype_bytes=2, hidden=896,
                         intermediate=4864)  # Qwen2.5-0.5B
    prompts = [[g] * (200 + g) for g in range(64) for _ in range(8)]  # 64 groups of 8, prompts of 200..263
    # one row of 4,096 new tokens: 4,095 generated slots and a quarter more for a compaction's copy
    assert row_bytes(shape, 4096) == int(4095 * 12288 * 1.25) + 12 * 4096
    for k in (1, 7, 8, 9, 330, 511, 512):
        need = chunk_bytes(shape, prompts[:k], 4096)
        assert rows_that_fit(shape, prompts, 4096, need + MARGIN_BYTES) == k
        assert rows_that_fit(shape, prompts, 4096, need + MARGIN_BYTES - 1) == k - 1
    assert rows_that_fit(shape, prompts, 4096, 0) == 0
    # the H100 async engine's share (0.3 of 79.18 GiB, ~2 GiB of weights): ~330 rows, not 512
    assert 300 < rows_that_fit(shape, prompts, 4096, int(21.75 * 2**30)) < 360


def _engine(module, own_weights: bool, max_batch_size: int = 8) -> HFEngine:
    cfg = EngineConfig(temperature=0.8, ignore_eos=True, static_cache=True, decode_kernels="torch", sync_every=2,
                       max_batch_size=max_batch_size, max_new_tokens=6)
    return HFEngine(module, cfg, eos_token_ids=[1], pad_token_id=0, device=torch.device("cpu"),
                    own_weights=own_weights)


def _requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", [4 + i % 3, 9, 3], seed=i) for i in range(n)]


def _free_for(module, rows: list[GenerationRequest], n_new: int = 6) -> int:
    return chunk_bytes(hf_fast.decoder_shape(module), [r.prompt_ids for r in rows], n_new) + MARGIN_BYTES


def test_a_colocated_call_larger_than_the_free_memory_runs_in_chunks_that_fit(tiny_policy, monkeypatch):
    requests = _requests(8)
    reference = asyncio.run(_engine(tiny_policy, own_weights=False).generate_all(requests))  # no bound on CPU
    free = _free_for(tiny_policy, requests[:3])
    monkeypatch.setattr(hf, "free_device_bytes", lambda device: free)
    engine = _engine(tiny_policy, own_weights=False)
    chunks = []
    real_chunk = engine._static_chunk
    engine._static_chunk = lambda reqs, start: (chunks.append([r.request_id for r in reqs]), real_chunk(reqs, start))[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = asyncio.run(engine.generate_all(requests))
        asyncio.run(engine.generate_all(requests))  # warned once per engine
    assert chunks[:3] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7"]]
    messages = [str(w.message) for w in caught if "chunks take" in str(w.message)]
    assert len(messages) == 1 and "a chunk of 8 rows with up to 6 new tokens" in messages[0]
    assert "so chunks take 3 rows at a time" in messages[0]
    for g, r in zip(got, reference):
        assert g.response_ids == r.response_ids and g.logprobs == pytest.approx(r.logprobs, abs=1e-5)


def test_a_row_that_cannot_fit_alone_is_an_error_naming_the_sizes(tiny_policy, monkeypatch):
    free = _free_for(tiny_policy, _requests(1)) - 1
    monkeypatch.setattr(hf, "free_device_bytes", lambda device: free)
    for own_weights in (False, True):
        with pytest.raises(RuntimeError) as info:
            asyncio.run(_engine(tiny_policy, own_weights).generate_all(_requests(2)))
        assert str(info.value).startswith("hf engine on cpu: one row of a 3-token prompt and 6 new tokens needs ")
        assert f"and {free / 2**30:.2f} GiB is free" in str(info.value)


def test_the_merger_caps_each_chunk_at_the_rows_that_fit_and_a_failed_fit_fails_every_waiting_call():
    async def capped():
        runner = ScriptedChunks()
        merger = CallMerger(runner, max_rows=8, chunk_rows=lambda rows: min(len(rows), 3))
        first = asyncio.create_task(_collect(merger, _rows("a0", "a1", "a2", "a3")))
        await asyncio.sleep(0)
        second = asyncio.create_task(_collect(merger, _rows("b0", "b1", "b2")))
        return runner.chunks, await first, await second

    chunks, first, second = asyncio.run(capped())
    assert chunks == [["a0", "a1", "a2"], ["a3", "b0", "b1"], ["b2"]]
    assert first == ["a0", "a1", "a2", "a3"] and second == ["b0", "b1", "b2"]

    def no_room(rows):
        raise RuntimeError("no room")

    async def failing():
        merger = CallMerger(ScriptedChunks(), max_rows=8, chunk_rows=no_room)
        return await asyncio.gather(_collect(merger, _rows("a0")), _collect(merger, _rows("b0")),
                                    return_exceptions=True)

    assert [str(e) for e in asyncio.run(failing())] == ["no room", "no room"]
