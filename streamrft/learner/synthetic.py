"""A train batch shaped like the loop's, with random tokens: what the learner's benchmarks and the compile
warm-up (learner/compile_warmup.py) hand to ``ActorUpdate.train_step`` without a rollout."""

from __future__ import annotations

import math


def synthetic_batch(B: int, P: int, R: int | list[int], vocab: int, samples: int, seed: int = 0):
    """B ``TrainSample``s as the feed hands them to ``actor.train_step``: groups of ``samples`` per prompt;
    every response ``R`` tokens long, or sample i's ``R[i]`` (the long-tailed workload)."""
    import torch

    from protocols.pipeline import Completion, ScoredSample
    from streamrft.runtime.feed import TrainSample

    lengths = R if isinstance(R, list) else [R] * B
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        group, k = divmod(i, samples)
        c = Completion(sample_id=f"g{group}-{k}", group_id=f"g{group}", step=0, prompt_index=group,
                       sample_index=k, prompt_text="", response_text="", n_samples=samples, finish_reason="length",
                       policy_version=0, prompt_len=P, response_len=n)
        adv = float(torch.randn((), generator=g))
        out.append(TrainSample(
            header=ScoredSample(completion=c, reward=adv),
            prompt_ids=torch.randint(3, vocab, (P,), generator=g),
            response_ids=torch.randint(3, vocab, (n,), generator=g),
            # a random-init model samples ~uniformly: log-probs near -log V (importance ratios near 1)
            behaviour_logprobs=-math.log(vocab) + 0.01 * torch.randn(n, generator=g),
            advantages=torch.full((n,), adv)))
    return out
