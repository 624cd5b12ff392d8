"""Concurrent generate() calls share static-cache chunks (engines/call_merge.py): the scheduler on a scripted
chunk runner, then the real engine (own weights, static cache, CPU) against each row decoded alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GeneratedSample, GenerationRequest
from streamrft.engines.call_merge import CallMerger
from streamrft.engines.hf import HFEngine


class ScriptedChunks:
    """A chunk runner that records each chunk's rows, yields one sample per row after a loop turn (rows whose
    id starts with "boom" raise instead; rows in ``held`` first wait for ``gate``) and records which chunks were
    closed before their end."""

    def __init__(self, held: frozenset[str] = frozenset()):
        self.chunks: list[list[str]] = []
        self.unfinished_closed: list[int] = []
        self.held = held
        self.gate = asyncio.Event()

    async def __call__(self, rows: list[GenerationRequest]):
        index = len(self.chunks)
        self.chunks.append([r.request_id for r in rows])
        done = 0
        try:
            for r in rows:
                if r.request_id in self.held:
                    await self.gate.wait()
                await asyncio.sleep(0)
                if r.request_id.startswith("boom"):
                    raise RuntimeError(f"chunk {index} failed at {r.request_id}")
                done += 1
                yield GeneratedSample(r.request_id, [r.seed], [0.0], "length", 0)
        finally:
            if done < len(rows):
                self.unfinished_closed.append(index)


def _rows(*ids: str) -> list[GenerationRequest]:
    return [GenerationRequest(i, [1], seed=n) for n, i in enumerate(ids)]


async def _collect(merger: CallMerger, rows: list[GenerationRequest]) -> list[str]:
    return [s.request_id async for s in merger.generate(rows)]


def test_calls_waiting_behind_a_chunk_are_merged_first_come_first_served_up_to_max_rows():
    async def run():
        runner = ScriptedChunks()
        merger = CallMerger(runner, max_rows=4)
        first = asyncio.create_task(_collect(merger, _rows("a0", "a1")))
        await asyncio.sleep(0)  # a's chunk starts alone
        rest = [asyncio.create_task(_collect(merger, _rows(*ids)))
                for ids in (("b0", "b1", "b2"), ("c0",), ("d0", "d1"))]
        return runner, merger, [await first] + [await t for t in rest]

    runner, merger, outs = asyncio.run(run())
    assert runner.chunks == [["a0", "a1"], ["b0", "b1", "b2", "c0"], ["d0", "d1"]]
    assert outs == [["a0", "a1"], ["b0", "b1", "b2"], ["c0"], ["d0", "d1"]]  # each call gets exactly its rows
    assert merger.chunks_run == 3 and runner.unfinished_closed == []


def test_a_call_larger_than_max_rows_spans_chunks_and_ends_after_its_last():
    async def run():
        runner = ScriptedChunks()
        merger = CallMerger(runner, max_rows=2)
        out = await _collect(merger, _rows("a0", "a1", "a2", "a3", "a4"))
        return runner.chunks, out

    chunks, out = asyncio.run(run())
    assert chunks == [["a0", "a1"], ["a2", "a3"], ["a4"]]
    assert out == ["a0", "a1", "a2", "a3", "a4"]


def test_a_failed_chunk_raises_in_every_call_with_rows_in_it_and_the_next_calls_still_run():
    async def run():
        runner = ScriptedChunks()
        merger = CallMerger(runner, max_rows=8)
        first = asyncio.create_task(_collect(merger, _rows("x0")))
        await asyncio.sleep(0)
        calls = [asyncio.create_task(_collect(merger, _rows(*ids))) for ids in (("a0", "boom"), ("b0", "b1"))]
        results = await asyncio.gather(first, *calls, return_exceptions=True)
        after = await _collect(merger, _rows("c0"))  # the merger still serves later calls
        return runner.chunks, results, after

    chunks, results, after = asyncio.run(run())
    assert chunks == [["x0"], ["a0", "boom", "b0", "b1"], ["c0"]]
    assert results[0] == ["x0"]
    for failed in results[1:]:
        assert isinstance(failed, RuntimeError) and str(failed) == "chunk 1 failed at boom"
    assert after == ["c0"]


def test_a_closed_call_loses_its_queued_rows_and_a_chunk_nobody_listens_to_is_closed():
    async def run():
        runner = ScriptedChunks(held=frozenset({"a1"}))
        merger = CallMerger(runner, max_rows=2)
        stream = merger.generate(_rows("a0", "a1", "a2", "a3"))
        first = await stream.__anext__()  # the chunk (a0, a1) now waits inside its second row
        await stream.aclose()  # the only caller leaves: the running chunk is cancelled, a2/a3 never run
        for _ in range(5):
            await asyncio.sleep(0)
        runner.gate.set()
        later = await _collect(merger, _rows("b0"))
        return runner, first.request_id, later

    runner, first, later = asyncio.run(run())
    assert first == "a0" and later == ["b0"]
    assert runner.chunks == [["a0", "a1"], ["b0"]] and runner.unfinished_closed == [0]


def test_a_request_id_already_in_flight_is_refused_before_anything_runs():
    async def run():
        runner = ScriptedChunks()
        merger = CallMerger(runner, max_rows=4)
        first = asyncio.create_task(_collect(merger, _rows("a0", "a1")))
        await asyncio.sleep(0)
        with pytest.raises(ValueError) as info:
            await _collect(merger, _rows("b0", "a1"))
        return runner.chunks, await first, str(info.value)

    chunks, first, message = asyncio.run(run())
    assert message == ("generate(): request id 'a1' is already in flight in another generate() call on this "
                       "engine; request ids must be unique among calls in flight")
    assert chunks == [["a0", "a1"]] and first == ["a0", "a1"]


def _engine(module: torch.nn.Module, own_weights: bool) -> HFEngine:
    cfg = EngineConfig(temperature=0.8, ignore_eos=True, static_cache=True, decode_kernels="torch", sync_every=2,
                       max_batch_size=8)
    return HFEngine(module, cfg, eos_token_ids=[1], pad_token_id=0, device=torch.device("cpu"),
                    own_weights=own_weights)


def test_the_async_engine_merges_calls_waiting_behind_a_chunk_and_each_row_decodes_as_if_alone(tiny_policy):
    """One call of 2 rows, then three single-group calls made while it decodes (as the Generator makes them when
    credits come back): they run as one chunk, not three, and every row's tokens and log-probs are the ones it
    gets decoded alone."""
    first = [GenerationRequest("a0", [4, 5, 13, 6], seed=1, max_new_tokens=12),
             GenerationRequest("a1", [7, 8], seed=2, max_new_tokens=3)]
    later = [[GenerationRequest(f"g{k}-{j}", [5 + k, 9, 3], seed=10 * k + j, max_new_tokens=4 + 3 * j)
              for j in range(2)] for k in range(3)]
    engine = _engine(tiny_policy, own_weights=True)

    async def run():
        out: dict[str, GeneratedSample] = {}
        tasks = []
        async for s in engine.generate(first):
            out[s.request_id] = s
            if s.request_id == "a1":  # a0 still decoding: the groups queue behind its chunk
                tasks = [asyncio.create_task(engine.generate_all(reqs)) for reqs in later]
        for reqs, task in zip(later, tasks):
            samples = await task
            assert [s.request_id for s in samples] == [r.request_id for r in reqs]
            out.update((s.request_id, s) for s in samples)
        return out

    merged = asyncio.run(run())
    assert engine._merger.chunks_run == 2
    alone = _engine(tiny_policy, own_weights=False)
    for req in first + [r for reqs in later for r in reqs]:
        ref = asyncio.run(alone.generate_all([req]))[0]
        got = merged[req.request_id]
        assert got.response_ids == ref.response_ids and len(got.response_ids) == req.max_new_tokens
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
