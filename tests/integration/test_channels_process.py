"""A channel between two real processes: a sender subprocess streams to a slow receiver here."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from protocols import Control, MicrobatchHeader
from streamrft.runtime.channels import ChannelReceiver, channel_address

SENDER_SCRIPT = Path(__file__).with_name("channels_sender_process.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
COUNT = 100
CAPACITY = 4


def start_sender(address: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen(
        [sys.executable, str(SENDER_SCRIPT), address, str(COUNT)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


@pytest.fixture
def resources():
    """Tracks the context, receivers and processes of one test; all are closed or reaped here."""
    ctx = zmq.asyncio.Context()
    tracked = {"ctx": ctx, "receivers": [], "procs": []}
    yield tracked
    for proc in tracked["procs"]:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    for receiver in tracked["receivers"]:
        receiver.close()
    terminator = threading.Thread(target=ctx.term, daemon=True)
    terminator.start()
    terminator.join(5.0)
    if terminator.is_alive():
        pytest.fail("zmq context term() hung: a socket opened by this test was never closed")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_second_process_streams_100_messages_in_order_under_backpressure(resources, transport):
    address = channel_address(transport, "procs", 0, uuid.uuid4().hex[:8])

    async def consume():
        if transport == "ipc":
            # The sender starts first and connects before anything is bound: the handshake waits.
            resources["procs"].append(start_sender(address))
            await asyncio.sleep(0.2)
        receiver = ChannelReceiver(
            address, CAPACITY, name="procs", rank=0, message_type=MicrobatchHeader | Control, ctx=resources["ctx"]
        )
        resources["receivers"].append(receiver)
        if transport == "tcp":
            resources["procs"].append(start_sender(receiver.address))  # the real port, chosen at bind
        try:
            for i in range(COUNT):
                header, tensors = await receiver.recv(timeout=20.0)
                assert isinstance(header, MicrobatchHeader) and header.step == i, f"message {i} out of order"
                assert header.sample_ids == [f"s{i}"]
                assert torch.equal(tensors["ids"], torch.arange(i, i + i % 5, dtype=torch.int64))
                assert tensors["weights"].dtype == torch.bfloat16 and tensors["weights"].shape == (2, 3)
                assert torch.all(tensors["weights"] == float(i % 64))
                await asyncio.sleep(0.01)  # a slow consumer: the sender must wait for credits
            stop, _ = await receiver.recv(timeout=20.0)
            return stop, receiver.peak_qsize
        finally:
            receiver.close()

    stop, peak_qsize = asyncio.run(asyncio.wait_for(consume(), 60.0))
    proc = resources["procs"][0]
    stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, f"sender process failed:\n{stderr}"
    assert isinstance(stop, Control) and stop.signal == "stop"
    # The inbox filled up (backpressure was exercised) and never held more than its capacity.
    assert peak_qsize == CAPACITY
    max_credits = int(stdout.strip().rsplit("max_credits=", 1)[-1])
    assert 1 <= max_credits <= CAPACITY
