"""Runtime values the stages do not push themselves: channel pressure sampled at scrape time, and MFU.

Queue depth, credits and in-flight counts change between steps, so :func:`probe_pipeline` reads them
when Prometheus scrapes (``PipelineMetrics.on_scrape``) instead of once per step. It only reads ints
and ``len()`` of containers owned by the event loop, which is safe from the exporter's thread.

MFU (PaLM, Chowdhery et al. 2022, appendix B) counts the model FLOPs of one training step,

    flops = 6 · N · tokens            (forward 2·N·tokens + backward 4·N·tokens per token)

with N the trainable parameter count and tokens every token the policy forward/backward ran on
(prompt + response), and divides by the time the update took times the peak rate of all ranks:

    mfu = flops / (train_seconds · peak_flops · world_size)

Left out: attention's O(T²) term, the reference/old-logprob forwards and rollout FLOPs (so MFU here
is the learner's utilisation during its update, a lower bound of the device's).
"""

from __future__ import annotations

import math


def probe_pipeline(metrics, pipeline, accounting) -> None:
    """Set queue depth / credits / in flight of every stage from its channels (called per scrape).

    queue_depth{stage}: items in the stage's inbox; credits{stage}: credits the stage's outbox may
    still spend; in_flight{stage}: item tasks of concurrent stages (reward, teacher), and
    in_flight{stage="pipeline"} = admitted - (trained + filtered + failed), the samples anywhere in
    the pipeline.
    """
    for stage in pipeline.stages:
        inbox, outbox = getattr(stage, "inbox", None), getattr(stage, "outbox", None)
        if inbox is not None:
            metrics.queue_depth.labels(stage=stage.name).set(inbox.qsize())
        if outbox is not None:
            metrics.credits.labels(stage=stage.name).set(outbox.credits)
        tasks = getattr(stage, "tasks", None)
        if tasks is not None:
            metrics.in_flight.labels(stage=stage.name).set(len(tasks))  # done-but-unreaped tasks included
    metrics.in_flight.labels(stage="pipeline").set(accounting.admitted - accounting.settled)


def trainable_parameters(module) -> int:
    """N of the 6·N·tokens rule: parameters with requires_grad (LoRA counts only its adapters).
    A sharded (DTensor) parameter's numel() is its global size."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def training_flops(n_params: int, tokens: float) -> float:
    return 6.0 * n_params * tokens


def mfu(flops: float, seconds: float, peak_flops: float, world_size: int) -> float:
    """Model FLOPs utilisation in [0, 1]; NaN when the peak rate is unknown (peak_flops <= 0)."""
    if peak_flops <= 0 or seconds <= 0:
        return math.nan
    return flops / (seconds * peak_flops * world_size)
