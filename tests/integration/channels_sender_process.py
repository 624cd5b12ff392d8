"""Second process for test_channels_process.py: streams numbered messages with tensors to a receiver.

Usage: python channels_sender_process.py ADDRESS COUNT
Message i is MicrobatchHeader(step=i) with tensors ``ids`` int64 arange(i, i + i % 5) (empty when
i % 5 == 0) and ``weights`` bfloat16 full((2, 3), i % 64); a Control("stop") follows the last one.
Prints ``max_credits=N`` (the most credits this sender ever held) so the test can check the bound.
"""

import asyncio
import sys

import torch

from protocols import Control, MicrobatchHeader
from streamrft.runtime.channels import ChannelSender


def message(i: int) -> tuple[MicrobatchHeader, dict[str, torch.Tensor]]:
    tensors = {
        "ids": torch.arange(i, i + i % 5, dtype=torch.int64),
        "weights": torch.full((2, 3), float(i % 64), dtype=torch.bfloat16),
    }
    return MicrobatchHeader(step=i, sample_ids=[f"s{i}"], n_tokens=i % 5), tensors


async def main(address: str, count: int) -> None:
    sender = ChannelSender(address, name="procs", rank=0, connect_timeout=20.0)
    max_credits = 0
    try:
        for i in range(count):
            header, tensors = message(i)
            await sender.send(header, tensors, timeout=20.0)
            max_credits = max(max_credits, sender.credits + 1)  # + the one just spent
        await sender.send(Control(signal="stop", reason="done"), timeout=20.0)
    finally:
        sender.close()
    print(f"max_credits={max_credits}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
