"""The long-tailed response-length workload of gpu_grpo.py (``--workload longtail``), the same for every system.

Each sample's response length is drawn from its own seed: ``length(seed) = min(cap, max(1, round(median ·
exp(sigma · z))))`` with ``z ~ N(0, 1)`` from ``random.Random(seed)`` (log-normal, median 512 and cap 4096
on the GPU shapes). The seed is StreamRFT's per-sample seed ``sample_seed(run_seed, step, prompt position,
sample index)``; TRL's row ``r`` of its ``k``-th generate call (prompts repeated ``n`` times in a row) is
sample ``(k, r // n, r % n)`` under the same function, so both systems generate the same lengths at every
step (the prompts differ: each system draws its own; the reward is random either way).

How the length is enforced, with EOS at the last position in both:
- TRL (HF ``generate``): ``ForceLengthProcessor``, a logits processor that masks EOS before a row's last
  position and leaves only EOS at it; generate stops a row at EOS (and the call when every row stopped).
- StreamRFT: its static-cache engine has no logits processors (the sampling is fused), so ``force_lengths``
  wraps the engine's ``generate``: each request asks for exactly ``length(seed)`` new tokens
  (``GenerationRequest.max_new_tokens``, with ``engine.ignore_eos=true`` so no earlier EOS ends it; the KV
  cache is sized from the largest request), and the sample's last token is replaced by EOS with log-prob 0
  (what forcing it would give), finish reason "stop". Same token counts, same EOS-terminated sequences.
  In the async placement the engines live in processes of their own: each runs this module
  (``python -m longtail SPEC``: StreamRFT's engine worker, every engine it builds wrapped the same way; the
  shape and the EOS id in ``LONGTAIL_ENV``, set by gpu_grpo.py with ``AsyncLearnerPipeline.worker_module``).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from dataclasses import dataclass, replace

LONGTAIL_ENV = "STREAMRFT_BENCH_LONGTAIL"  # {"shape": LongTail's fields, "eos_id": int}, for the engine processes


@dataclass(frozen=True)
class LongTail:
    median: int = 512
    sigma: float = 1.0
    cap: int = 4096

    def length(self, seed: int) -> int:
        """The response length of the sample with this seed (a pure function of the seed)."""
        z = random.Random(seed).gauss(0.0, 1.0)
        return min(self.cap, max(1, round(self.median * math.exp(self.sigma * z))))

    def step_lengths(self, run_seed: int, step: int, prompts: int, samples: int) -> list[int]:
        """Lengths of one step's samples in row order (prompt-major, as TRL repeats prompts)."""
        from streamrft.engines.sampling import sample_seed

        return [self.length(sample_seed(run_seed, step, p, j)) for p in range(prompts) for j in range(samples)]


class ForceLengthProcessor:
    """HF logits processor: row ``i`` ends with EOS as its ``lengths[i]``-th new token (EOS masked before)."""

    def __init__(self, lengths: list[int], prompt_width: int, eos_id: int):
        self.lengths, self.prompt_width, self.eos_id = lengths, prompt_width, eos_id

    def __call__(self, input_ids, scores):
        import torch

        t = input_ids.shape[1] - self.prompt_width  # new tokens so far: this call picks token index t
        last = torch.tensor([n - 1 for n in self.lengths], device=scores.device) == t
        scores = scores.clone()
        scores[:, self.eos_id] = float("-inf")
        scores[last] = float("-inf")
        scores[last, self.eos_id] = 0.0
        return scores


def force_lengths(engine, shape: LongTail, eos_id: int) -> None:
    """Wrap ``engine.generate`` so each request decodes exactly ``shape.length(request.seed)`` tokens,
    the last one EOS (see the module docstring)."""
    original = engine.generate

    async def generate(requests, mm_inputs=None):
        sized = [replace(r, max_new_tokens=shape.length(r.seed)) for r in requests]
        async for sample in original(sized, mm_inputs):
            if sample.response_ids:
                sample.response_ids[-1] = eos_id
                sample.logprobs[-1] = 0.0
                sample.finish_reason = "stop"
            yield sample

    engine.generate = generate


def engine_process_main(argv: list[str]) -> int:
    """An async engine process (``python -m longtail SPEC``): StreamRFT's engine process, every engine it builds
    decoding the long-tailed lengths (``force_lengths``; the shape and EOS id from ``LONGTAIL_ENV``)."""
    import streamrft.engines as engines
    from streamrft import engine_process

    spec = json.loads(os.environ[LONGTAIL_ENV])
    shape, eos_id, build = LongTail(**spec["shape"]), spec["eos_id"], engines.build_engine

    def build_forced(*args, **kwargs):
        engine = build(*args, **kwargs)
        force_lengths(engine, shape, eos_id)
        return engine

    # engine_process.build_engine_parts imports it from streamrft.engines when it runs
    engines.build_engine = build_forced
    return engine_process.main(argv)


if __name__ == "__main__":
    sys.exit(engine_process_main(sys.argv[1:]))
