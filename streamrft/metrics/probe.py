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

``peak_flops`` is ``metrics.peak_flops`` or, when that is 0, :func:`detect_peak_flops`: the dense
(no 2:4 sparsity) bf16 tensor-core rate of one GPU from NVIDIA's datasheets, by device name. On a CPU or
an unknown GPU there is no peak, no ``mfu`` scalar and no ``streamrft_mfu`` series.
"""

from __future__ import annotations

import math
import re

# (pattern on torch.cuda.get_device_name(), peak dense bf16 FLOP/s of one GPU). First match wins, so a
# family's variants (PCIe, NVL) come before its default (SXM). \b keeps H20 from matching H200 and
# GH200 from matching H200.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 2.5e15),
    (r"\bB200\b", 2.25e15),
    (r"\bB100\b", 1.75e15),
    (r"\bGH200\b", 989e12),
    (r"\bH(100|800)\b.*\bPCIe\b", 756e12),
    (r"\bH(100|200)\b.*\bNVL\b", 835e12),
    (r"\bH(100|200|800)\b", 989e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200")
    (r"\bH20\b", 148e12),
    (r"\bA(100|800)\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
)


def peak_flops_for_device(name: str) -> float:
    """Peak dense bf16 FLOP/s of the GPU called ``name`` (as torch.cuda.get_device_name gives it);
    0.0 when the name is not in :data:`PEAK_BF16_FLOPS`."""
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, name, re.IGNORECASE):
            return flops
    return 0.0


def detect_peak_flops(device) -> float:
    """Peak dense bf16 FLOP/s of ``device`` (a torch.device); 0.0 for a CPU or an unknown GPU."""
    if getattr(device, "type", "cpu") != "cuda":
        return 0.0
    import torch

    return peak_flops_for_device(torch.cuda.get_device_name(device))


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
    """Model FLOPs utilisation in [0, 1]; NaN when the peak rate is unknown (peak_flops <= 0; callers
    leave ``mfu`` out then, see the module docstring)."""
    if peak_flops <= 0 or seconds <= 0:
        return math.nan
    return flops / (seconds * peak_flops * world_size)
