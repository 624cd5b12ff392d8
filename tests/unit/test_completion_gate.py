"""CompletionGate: settled once, by commit() or abandon(); wait() is bounded and names stage and rank."""

import threading
import time

import pytest

from streamrft.checkpoint.background import CheckpointSaveError
from streamrft.checkpoint.completion import CompletionGate


def test_commit_then_wait_is_committed_and_runs_on_commit_once():
    ran = []
    gate = CompletionGate("out/checkpoints/step_1", rank=0, timeout_s=5, on_commit=lambda: ran.append(1))
    assert not gate.settled
    gate.commit()
    gate.commit()  # the loop commits every step; a second commit must not write meta.json again
    gate.abandon()  # nor may a later abandon undo the completion
    assert gate.wait() is True and ran == [1] and gate.settled


def test_abandon_then_wait_is_not_committed_and_a_later_commit_changes_nothing():
    ran = []
    gate = CompletionGate("out/checkpoints/step_2", rank=1, timeout_s=5, on_commit=lambda: ran.append(1))
    gate.abandon()
    gate.commit()
    assert gate.wait() is False and ran == []


def test_a_commit_from_another_thread_wakes_the_waiter():
    gate = CompletionGate("step_3", rank=0, timeout_s=10)
    threading.Timer(0.2, gate.commit).start()
    started = time.perf_counter()
    assert gate.wait() is True
    assert 0.15 <= time.perf_counter() - started < 5


def test_a_commit_racing_an_abandon_decides_once():
    # whichever wins, every waiter sees the same decision and on_commit runs exactly when it is a commit
    for _ in range(50):
        ran = []
        gate = CompletionGate("step_4", rank=0, timeout_s=5, on_commit=lambda: ran.append(1))
        threads = [threading.Thread(target=gate.commit), threading.Thread(target=gate.abandon)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert ran == ([1] if gate.wait() else [])


def test_wait_times_out_with_an_error_naming_stage_rank_and_checkpoint():
    gate = CompletionGate("out/checkpoints/step_5", rank=3, timeout_s=0.1)
    started = time.perf_counter()
    with pytest.raises(CheckpointSaveError) as info:
        gate.wait()
    assert 0.09 <= time.perf_counter() - started < 5
    assert str(info.value) == (
        "stage checkpoint_commit on rank 3: checkpoint out/checkpoints/step_5 was neither committed nor abandoned "
        "within checkpoint.save_timeout_s=0.1 s (its step's records were not written); it has no meta.json, so "
        "the previous complete checkpoint stays the latest")
    assert not gate.settled  # a timeout decides nothing: a late commit still completes it
    gate.commit()
    assert gate.wait() is True
