"""Deterministic fake trajectory records, for tests, benchmarks and trying the analysis tools."""

from __future__ import annotations

import random
import struct

from protocols import TrajectoryRecord


def _f32(x: float) -> float:
    # Real log-probs and entropies come from float32 tensors; keep the fakes exactly representable.
    return struct.unpack("f", struct.pack("f", x))[0]


def synthetic_records(
    n: int, response_len: int = 32, run_id: str = "synthetic", rank: int = 0, step: int = 0, seed: int = 0
) -> list[TrajectoryRecord]:
    """``n`` records whose ``response`` has one character per token id (character-level), a rising
    entropy profile, and alternating positive / negative advantages."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        text = "".join(rng.choice("0123456789+= wait") for _ in range(response_len))
        records.append(
            TrajectoryRecord(
                run_id=run_id, rank=rank, step=step, policy_version=step,
                sample_id=f"s{step}-p{i // 4}-{i % 4}", group_id=f"s{step}-p{i // 4}",
                prompt=f"What is {i} + {i}?", response=text,
                prompt_ids=[ord(c) for c in f"What is {i} + {i}?"], response_ids=[ord(c) for c in text],
                behaviour_logprobs=[_f32(-rng.random()) for _ in text],
                policy_logprobs=[_f32(-rng.random()) for _ in text],
                entropy=[_f32(3.0 * rng.random()) for _ in text], reward=float(i % 2),
                reward_components={"correct": float(i % 2), "format": 1.0},
                advantage=0.5 if i % 2 else -0.5,
                finish_reason="stop", timings={"generate": 0.01 * i},
            )
        )
    return records
