"""Checkpoint staging's host slab (streamrft/checkpoint/pinning.py): layout, page-locking in chunks, unlocking.

The driver calls are injected here (this machine has no GPU); the last test runs the real cudaHostRegister
on a GPU machine."""

import gc
import time
import warnings

import pytest
import torch

from streamrft.checkpoint import pinning, staging
from streamrft.checkpoint.pinning import ALIGN, PAGE, HostSlab, layout
from streamrft.checkpoint.staging import HostStager
from streamrft.runtime.host_idle import HostIdleWindow

SPECS = [(torch.Size([3, 5]), torch.float32), (torch.Size([]), torch.int64), (torch.Size([7]), torch.bool),
         (torch.Size([0, 4]), torch.bfloat16), (torch.Size([1000]), torch.float64)]


class Driver:
    """Records page-lock calls; ``fail_at``: the call number (1-based) that the driver refuses."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.locked, self.unlocked = fail_at, [], []

    def register(self, address: int, nbytes: int):
        if len(self.locked) + 1 == self.fail_at:
            return "cudaErrorMemoryAllocation: out of memory"
        self.locked.append((address, nbytes))
        return None

    def unregister(self, address: int) -> None:
        self.unlocked.append(address)


def test_layout_aligns_every_buffer_and_rounds_the_slab_to_whole_pages():
    offsets, runs, total = layout(SPECS)
    sizes = [3 * 5 * 4, 8, 7, 0, 8000]
    assert offsets == [0, 64, 128, 192, 192]  # 60 -> 64, 72 -> 128, 135 -> 192, 192 (empty) -> 192
    assert all(o % ALIGN == 0 for o in offsets)
    assert total % PAGE == 0 and total >= offsets[-1] + sizes[-1]
    assert runs == [(0, total)]  # all of it fits one chunk


def test_lock_chunks_hold_whole_buffers_start_on_pages_and_tile_the_slab():
    # a copy whose host range crosses from one registration into the next fails on the GPU, so no buffer may
    # straddle a chunk boundary; a buffer larger than a chunk is a chunk by itself
    specs = [(torch.Size([PAGE // 2]), torch.uint8), (torch.Size([PAGE]), torch.uint8),
             (torch.Size([5 * PAGE]), torch.uint8), (torch.Size([10]), torch.uint8), (torch.Size([0]), torch.uint8),
             (torch.Size([PAGE // 4]), torch.float32)]
    offsets, runs, total = layout(specs, chunk_bytes=2 * PAGE)
    assert offsets == [0, PAGE // 2, 2 * PAGE, 7 * PAGE, 7 * PAGE + 64, 7 * PAGE + 64]
    assert runs == [(0, 2 * PAGE), (2 * PAGE, 5 * PAGE), (7 * PAGE, 2 * PAGE)]
    assert total == 9 * PAGE
    for offset, (shape, dtype) in zip(offsets, specs):
        nbytes = shape.numel() * dtype.itemsize
        assert nbytes == 0 or sum(start <= offset and offset + nbytes <= start + size for start, size in runs) == 1


def test_a_slab_is_locked_in_page_aligned_chunks_that_tile_it_and_unlocked_once_when_dropped():
    driver = Driver()
    specs = SPECS + [(torch.Size([3 * PAGE]), torch.uint8)]  # more than two chunks of 2 pages
    slab = HostSlab(specs, pin=True, register=driver.register, unregister=driver.unregister, chunk_bytes=2 * PAGE)
    start = slab.memory.data_ptr()
    assert slab.pinned and start % PAGE == 0
    _, runs, _ = layout(specs, chunk_bytes=2 * PAGE)
    assert driver.locked == [(start + o, n) for o, n in runs] and len(runs) == 2  # small buffers, the big one
    assert sum(n for _, n in driver.locked) == slab.nbytes and all(a % PAGE == 0 for a, _ in driver.locked)
    for view, (shape, dtype) in zip(slab.views, specs):
        assert view.shape == shape and view.dtype == dtype and view.data_ptr() % ALIGN == 0
        assert view.numel() == 0 or start <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= start + slab.nbytes
    assert all(int(v.count_nonzero()) == 0 for v in slab.views)  # touched: zero-filled
    for i, view in enumerate(slab.views):
        view.fill_(i + 1)  # each buffer is its own memory: no fill reaches a neighbour
    assert [v.double().sum().item() for v in slab.views] == [15.0, 2.0, 7.0, 0.0, 5000.0, 6.0 * 3 * PAGE]
    views, locked = slab.views, [a for a, _ in driver.locked]
    del slab
    gc.collect()
    assert driver.unlocked == locked  # every chunk unlocked, once
    assert views[0].sum().item() == 15.0  # the buffers stay readable after the pages are unlocked


def test_pace_runs_before_each_chunk_with_the_seconds_the_previous_one_held_the_driver():
    driver, calls = Driver(), []

    def slow_register(address: int, nbytes: int):
        time.sleep(0.02)
        return driver.register(address, nbytes)

    specs = [(torch.Size([PAGE]), torch.uint8)] * 3
    slab = HostSlab(specs, pin=True, register=slow_register, unregister=driver.unregister, chunk_bytes=PAGE,
                    pace=lambda held: calls.append((held, len(driver.locked))))
    assert slab.pinned and len(driver.locked) == 3
    assert [locked for _, locked in calls] == [0, 1, 2]  # before each chunk, never in the middle of one
    assert calls[0][0] == 0.0 and all(held >= 0.02 for held, _ in calls[1:])
    assert all(int(v.count_nonzero()) == 0 for v in slab.views)  # every chunk touched before it was locked


def _stager_of_gpu_state(monkeypatch, driver: Driver) -> HostStager:
    """A stager whose state counts as on a GPU (so its prewarm page-locks), the driver calls recorded."""
    monkeypatch.setattr(pinning, "cuda_register", driver.register)
    monkeypatch.setattr(pinning, "cuda_unregister", driver.unregister)
    stager = HostStager()
    specs = stager._specs
    monkeypatch.setattr(stager, "_specs", lambda state: [(*spec[:3], True) for spec in specs(state)])
    return stager


def test_the_prewarm_page_locks_only_once_the_decode_window_opens(monkeypatch):
    driver, window = Driver(), HostIdleWindow()
    stager = _stager_of_gpu_state(monkeypatch, driver)
    stager.prewarm({"w": torch.ones(3, 4)}, window)
    time.sleep(0.3)
    assert driver.locked == [] and stager._prewarm.is_alive()  # the window is shut: waiting
    with window.opened():
        stager._prewarm.join(timeout=10)
    assert not stager._prewarm.is_alive() and len(driver.locked) == 1


def test_a_save_does_not_wait_for_the_window_nor_does_a_prewarm_past_its_patience(monkeypatch):
    driver = Driver()
    stager = _stager_of_gpu_state(monkeypatch, driver)
    live = {"w": torch.arange(12.0).reshape(3, 4)}
    stager.prewarm(live, HostIdleWindow())  # a window that never opens
    started = time.monotonic()
    staged = stager.stage(live)
    assert time.monotonic() - started < 5 and len(driver.locked) == 1 and stager.bytes_allocated == 0
    assert torch.equal(staged["w"], live["w"])

    monkeypatch.setattr(staging, "WINDOW_PATIENCE_S", 0.2)
    stager = _stager_of_gpu_state(monkeypatch, Driver())
    stager.prewarm(live, HostIdleWindow())
    stager._prewarm.join(timeout=10)
    assert not stager._prewarm.is_alive() and stager._slabs[0].pinned


def test_a_refused_page_lock_unlocks_what_was_locked_and_warns_naming_rank_and_bytes():
    driver = Driver(fail_at=2)
    with pytest.warns(RuntimeWarning, match=r"rank 3: page-locking \d+ bytes of host memory failed "
                                            r"\(cudaErrorMemoryAllocation: out of memory\)"):
        slab = HostSlab([(torch.Size([PAGE]), torch.uint8)] * 4, pin=True, register=driver.register,
                        unregister=driver.unregister, chunk_bytes=PAGE, rank=3)
    assert not slab.pinned and driver.unlocked == [driver.locked[0][0]] and len(driver.locked) == 1
    slab.views[0].fill_(1)  # still usable memory
    del slab
    gc.collect()
    assert len(driver.unlocked) == 1  # nothing left to unlock


def test_a_slab_for_host_tensors_is_not_locked():
    driver = Driver()
    slab = HostSlab(SPECS, pin=False, register=driver.register, unregister=driver.unregister)
    assert not slab.pinned and driver.locked == []


def test_the_stager_carves_every_buffer_from_one_slab_whether_prewarmed_or_not():
    live = {"w": torch.arange(12.0).reshape(3, 4), "opt": [{"m": torch.ones(5, dtype=torch.bfloat16),
                                                            "step": torch.tensor(3)}], "lr": 0.1}
    for prewarm in (True, False):
        stager = HostStager()
        if prewarm:
            stager.prewarm(live)
        staged = stager.stage(live)
        assert len(stager._slabs) == 1
        slab = stager._slabs[0]
        lo, hi = slab.memory.data_ptr(), slab.memory.data_ptr() + slab.nbytes
        for t in (staged["w"], staged["opt"][0]["m"], staged["opt"][0]["step"]):
            assert lo <= t.data_ptr() < hi
        assert stager.bytes_allocated == (0 if prewarm else 48 + 10 + 8) and stager.bytes_staged == 48 + 10 + 8
        assert torch.equal(staged["w"], live["w"]) and staged["opt"][0]["step"].item() == 3
    live["w"] = torch.zeros(2, 2)  # a changed shape gets a buffer of its own
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(stager.stage(live)["w"], torch.zeros(2, 2)) and stager.bytes_allocated == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locks through the CUDA driver")
def test_a_slab_is_page_locked_by_the_driver_and_copies_from_the_gpu_land():
    # the first buffer is four chunks' worth (a copy across two registrations failed here before)
    specs = [(torch.Size([1 << 20]), torch.float32), (torch.Size([3]), torch.int64),
             (torch.Size([200_000]), torch.float32), (torch.Size([200_000]), torch.bfloat16)]
    slab = HostSlab(specs, pin=True, chunk_bytes=1 << 20)
    # not Tensor.is_pinned(): torch 2.11 answers it for its own host allocator's blocks only (False here)
    assert slab.pinned
    sources = [torch.arange(s.numel(), device="cuda").to(d).reshape(s) for s, d in specs]
    for view, src in zip(slab.views, sources):
        view.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert all(torch.equal(v, s.cpu()) for v, s in zip(slab.views, sources))
    del slab
    gc.collect()
    torch.cuda.synchronize()  # unlocking left the driver in a good state
