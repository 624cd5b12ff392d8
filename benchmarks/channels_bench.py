"""Micro-benchmark of credit-based channels: messages/s and MB/s per transport and payload size.

Each row streams N messages (a Control header plus one float32 tensor) from a sender task to a
consumer task on one event loop, through inproc, ipc and tcp channels, and through a plain bounded
asyncio.Queue measured in the same run as the baseline (no serialization, no copy). ``vs queue`` is
the channel's messages/s divided by the queue's: the price of going through ZeroMQ.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/channels_bench.py [--capacity 64] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import torch
import zmq.asyncio

from protocols import Control
from streamrft.runtime.channels import ChannelReceiver, ChannelSender, channel_address

PAYLOADS = {"1KiB": 1 << 10, "4MiB": 4 << 20}
MESSAGES = {"1KiB": 5000, "4MiB": 200}


async def through_queue(tensor: torch.Tensor, count: int, capacity: int) -> float:
    queue: asyncio.Queue = asyncio.Queue(maxsize=capacity)

    async def produce():
        for i in range(count):
            await queue.put((Control(signal="data", step=i), {"payload": tensor}))

    start = time.perf_counter()
    producer = asyncio.create_task(produce())
    for _ in range(count):
        await queue.get()
    await producer
    return time.perf_counter() - start


async def through_channel(transport: str, tensor: torch.Tensor, count: int, capacity: int) -> float:
    ctx = zmq.asyncio.Context()
    address = channel_address(transport, "bench", 0, uuid.uuid4().hex[:8])
    receiver = ChannelReceiver(address, capacity, name="bench", rank=0, message_type=Control, ctx=ctx)
    sender = ChannelSender(receiver.address, name="bench", rank=0, ctx=ctx, connect_timeout=10.0)
    try:

        async def produce():
            for i in range(count):
                await sender.send(Control(signal="data", step=i), {"payload": tensor}, timeout=30.0)

        start = time.perf_counter()
        producer = asyncio.create_task(produce())
        for _ in range(count):
            header, tensors = await receiver.recv(timeout=30.0)
            assert tensors["payload"].numel() == tensor.numel()
        await producer
        return time.perf_counter() - start
    finally:
        sender.close()
        receiver.close()
        ctx.term()


async def main(capacity: int, scale: float) -> None:
    print(f"capacity={capacity}; one event loop, sender and consumer as tasks\n")
    print(f"{'transport':<10} {'payload':>8} {'messages':>9} {'msgs/s':>10} {'MB/s':>9} {'vs queue':>9}")
    for label, nbytes in PAYLOADS.items():
        tensor = torch.ones(nbytes // 4, dtype=torch.float32)
        count = max(10, int(MESSAGES[label] * scale))
        rows = [("queue", await through_queue(tensor, count, capacity))]
        for transport in ("inproc", "ipc", "tcp"):
            rows.append((transport, await through_channel(transport, tensor, count, capacity)))
        baseline = count / rows[0][1]
        for name, seconds in rows:
            rate = count / seconds
            print(f"{name:<10} {label:>8} {count:>9} {rate:>10.0f} {rate * nbytes / 1e6:>9.1f} {rate / baseline:>9.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=64, help="inbox capacity (credits) of every channel")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the message counts (0.1 for a quick look)")
    args = parser.parse_args()
    asyncio.run(main(args.capacity, args.scale))
