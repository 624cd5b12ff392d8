"""PhaseController: switches colocated GPUs between ROLLOUT and TRAIN, timing every switch.

ROLLOUT → TRAIN happens when the learner inbox holds a full train batch on every rank: one
all-reduce of the per-rank sample counts decides it (and gives the global batch size).
Then: close the admission gate and let running generate calls finish (``drain``; with
rollout.max_staleness > 0 the next step's first groups may be generating), engine.sleep() (free the KV
cache), reshard the learner, reload optimizer state, train.
TRAIN → ROLLOUT: offload optimizer state, push weights to the engine (the embedded hf engine runs the
learner's own module, so only the version moves), unshard for generation, engine.wake(), open the gate
for the new version.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

ROLLOUT, TRAIN = "rollout", "train"


def agree_on_batch(all_reduce_sum, local_samples: int, stop: bool) -> tuple[int, bool]:
    """The all-reduce before every train step (both placements' ``batch_ready``): (the global sample count,
    whether any rank stops)."""
    total, stops = all_reduce_sum(torch.tensor([float(local_samples), float(stop)])).tolist()
    return int(total), stops > 0


class PhaseController:
    def __init__(self, strategy, engine, all_reduce_sum, metrics=None, sleep_level: int = 1, push_full_weights: bool = False, bucket_bytes: int = 256 << 20, offload: bool = True, admission=None):
        self.strategy, self.engine = strategy, engine
        self.admission = admission  # the Pipeline: pause() / resume(version) of its admission gate
        self.offload = offload  # train.offload_between_phases
        # The embedded hf engine runs the learner's own module: only the version moves. vLLM and
        # SGLang hold their own copy: the full weights are pushed in buckets (every rank drains them).
        self.push_full_weights, self.bucket_bytes = push_full_weights, bucket_bytes
        self.pushed_bytes = 0
        self.all_reduce_sum = all_reduce_sum
        self.metrics = metrics
        self.sleep_level = sleep_level
        self.state = TRAIN  # the learner owns the devices until the first rollout
        self.timings: dict[str, float] = {}
        self.events: list[str] = []  # ordered record of what was done, for tests and logs

    @contextmanager
    def _timed(self, part: str):
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.timings[part] = seconds
        self.events.append(part)
        if self.metrics is not None:
            self.metrics.phase_switch_seconds.labels(transition=part).observe(seconds)

    def _set_state(self, state: str) -> None:
        self.state = state
        if self.metrics is not None:
            self.metrics.set_phase(state)

    async def enter_rollout(self, version: int) -> None:
        assert self.state == TRAIN, self.state
        started = time.perf_counter()
        with self._timed("offload"):
            if self.offload:
                self.strategy.offload()
        with self._timed("weight_push"):
            if self.push_full_weights and version > 0:
                self.pushed_bytes = 0
                for bucket in self.strategy.full_state_for_engine(self.bucket_bytes):
                    self.pushed_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    await self.engine.update_weights(bucket, version)
            else:
                await self.engine.update_weights([], version)
        if self.metrics is not None and self.pushed_bytes:
            self.metrics.weight_sync_bytes.inc(self.pushed_bytes)
            self.metrics.weight_sync_seconds.observe(self.timings["weight_push"])
        with self._timed("unshard"):
            self.strategy.unshard_for_rollout()
        with self._timed("wake"):
            await self.engine.wake()
        if self.admission is not None:
            await self.admission.resume(version)
        self.timings["train_to_rollout"] = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.phase_switch_seconds.labels(transition="train_to_rollout").observe(self.timings["train_to_rollout"])
        self._set_state(ROLLOUT)

    def batch_ready(self, local_samples: int, stop: bool = False) -> tuple[int, bool]:
        """Every rank has its full local batch, or wants to stop (a signal): one all-reduce of counts and stop
        flags; returns (the global count, whether any rank stops)."""
        with self._timed("decide"):
            return agree_on_batch(self.all_reduce_sum, local_samples, stop)

    async def enter_train(self) -> None:
        assert self.state == ROLLOUT, self.state
        started = time.perf_counter()
        with self._timed("drain"):
            if self.admission is not None:
                await self.admission.pause()
        with self._timed("sleep"):
            await self.engine.sleep(self.sleep_level)
        with self._timed("reshard"):
            self.strategy.reshard_after_rollout()
        with self._timed("reload"):
            if self.offload:
                self.strategy.reload()
        self.timings["rollout_to_train"] = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.phase_switch_seconds.labels(transition="rollout_to_train").observe(self.timings["rollout_to_train"])
        self._set_state(TRAIN)
