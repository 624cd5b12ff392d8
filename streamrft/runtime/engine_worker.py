"""The runtime half of an engine process of the async placement (``rollout.placement=async``).

The process itself is ``python -m streamrft.engine_process SPEC.json`` (streamrft/engine_process.py, the
composition root of an engine process: it builds the engine, its policy copy, the dataset, the reward scorer and
the teacher client). This module wires them into the rollout half of the pipeline for the process's share of every
step's prompts, and keeps no model code of its own:

    Generator ─► RewardScorer ─► [TeacherFetcher] ─► AdvantageStage ─► LearnerRouter ─► learner feeds

It never waits for the learner except through the admission gate: a group of step ``k`` is admitted
once the engine holds weights of version ``>= k - rollout.max_staleness``. New versions arrive on a
process group of their own (learner rank 0 + every engine process) in a background thread and are
loaded between decode chunks, so rows in flight keep their tokens (each token records its version).

It ends when learner rank 0 publishes the end of the run; the process dies with its parent (PR_SET_PDEATHSIG,
streamrft/parent_death.py), so a learner killed with SIGKILL leaves no engine behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch


@dataclass
class EngineParts:
    """What the composition root builds for an engine process (streamrft/engine_process.py ``build_engine_parts``)."""

    engine: Any  # a RolloutEngine over the process's own policy copy
    tokenizer: Any
    dataset: Any  # the PromptDataset of data.train_path
    scorer: Any  # the RewardScorer of reward.sources
    teacher: Any  # the teacher client, or None without a teacher


async def serve(cfg, spec: dict, build_parts: Callable[[Any, dict], EngineParts]) -> None:
    """Run engine process ``spec["engine_rank"]`` until the learner's end of the run: rendezvous, ``build_parts(cfg,
    spec)`` (the engine, its policy copy and the rest, made after the rendezvous store is reached), then the stages."""
    from streamrft.runtime.accounting import Accounting
    from streamrft.runtime.advantage_stage import AdvantageStage
    from streamrft.runtime.channels import ChannelReceiver, ChannelSender, channel_address
    from streamrft.runtime.gate import AdmissionGate, max_groups_in_flight
    from streamrft.runtime.generator import Generator
    from streamrft.runtime.router import LearnerRouter
    from streamrft.runtime.scoring import RewardScorerStage, TeacherFetcherStage
    from streamrft.runtime.stage import StageContext, StageError
    from streamrft.runtime.weight_sync import WeightSubscriber, new_weights_group

    import torch.distributed as dist

    rank, n_engines, timeout_s = spec["engine_rank"], spec["engine_ranks"], cfg.rollout.stage_timeout_s
    r = cfg.rollout
    torch.manual_seed(cfg.seed)
    store = dist.TCPStore(spec["store_host"], spec["store_port"], is_master=False, timeout=timedelta(seconds=timeout_s))
    parts = build_parts(cfg, spec)
    engine, tokenizer, dataset = parts.engine, parts.tokenizer, parts.dataset
    scorer, teacher = parts.scorer, parts.teacher
    accounting = Accounting(rank=rank)
    ctx = StageContext(rank=rank, stage_timeout_s=timeout_s, accounting=accounting, fail_fast=cfg.fail_fast)
    gate = AdmissionGate(r.max_staleness, max_groups_in_flight(r.channel_capacity, r.n_samples_per_prompt,
                                                               r.prompts_per_step // n_engines), version=-1)

    sockets = []

    def link(name, message_type):
        receiver = ChannelReceiver(channel_address("inproc", name, rank, spec["run_id"]), r.channel_capacity,
                                   name=name, rank=rank, message_type=message_type)
        sender = ChannelSender(receiver.address, name=name, rank=rank)
        sockets.extend([sender, receiver])
        return receiver, sender

    from protocols import Completion, Control, ScoredSample

    reward_in, to_reward = link("reward", Completion | Control)
    advantage_in, to_advantage = link("advantage", ScoredSample | Control)
    feedback_in, to_generator = link("generator_feedback", Control)
    feeds = [store.get(f"feed/{i}").decode() for i in range(spec["learner_ranks"])]
    to_learners = [ChannelSender(address, name=f"learner_feed_{i}", rank=rank) for i, address in enumerate(feeds)]
    generator = Generator(ctx, feedback_in, to_reward, engine, tokenizer, dataset, cfg, n_engines, gate)
    generator.start_step = spec["start_step"]
    router = LearnerRouter(to_learners, accounting, generator, rank)
    stages = [generator, AdvantageStage(ctx, advantage_in, router, to_generator, cfg)]
    if teacher is None:
        stages.append(RewardScorerStage(ctx, reward_in, to_advantage, scorer, cfg.reward.max_concurrency))
    else:
        teacher_in, to_teacher = link("teacher", ScoredSample | Control)
        stages += [RewardScorerStage(ctx, reward_in, to_teacher, scorer, cfg.reward.max_concurrency),
                   TeacherFetcherStage(ctx, teacher_in, to_advantage, teacher, cfg.reward.max_concurrency)]

    loop = asyncio.get_running_loop()
    finished = loop.create_future()  # the learner's "no more versions", or the subscriber's failure

    async def load(version: int, named: list) -> None:
        await engine.update_weights(named, version)
        await engine.wait_version(version, timeout_s)  # loaded (between decode steps when generating)
        await gate.set_version(version)
        if not gate.open:
            ctx.rollout_active.set()
            await gate.set_open(True)

    def on_weights(version: int | None, named: list | None, error: BaseException | None = None) -> None:
        """Called in the subscriber's thread for each version; None at the end of the run."""
        if error is not None:
            loop.call_soon_threadsafe(lambda: finished.done() or finished.set_exception(error))
        elif version is None:
            loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(None))
        else:
            asyncio.run_coroutine_threadsafe(load(version, named), loop).result()

    group = new_weights_group(store, rank + 1, n_engines + 1, timeout_s)  # gloo: staged through host memory
    subscriber = WeightSubscriber(group, src_rank=0, timeout_s=spec["weights_timeout_s"], rank=rank + 1)
    subscriber.start(on_weights)
    store.set(f"engine_ready/{rank}", "1")
    tasks = {asyncio.create_task(stage.run(), name=f"{stage.name}-engine{rank}"): stage.name for stage in stages}
    try:
        while not finished.done():
            done, _ = await asyncio.wait({finished, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            for task in done & set(tasks):
                exc = task.exception() if not task.cancelled() else None
                if exc is not None:
                    raise StageError(f"engine rank {rank}: stage {tasks[task]} failed: {exc!r}") from exc
        finished.result()
    finally:
        subscriber.stop()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=10)
        for sock in sockets:
            sock.close()
        router.close()
        await scorer.close()
        if teacher is not None:
            await teacher.close()


def exit_now(code: int) -> None:
    """End a process of the weights group (a failed engine process; the weight-sync test's workers) with
    ``code``, without the interpreter's teardown. After a peer of the
    weights group has died, the process group's C++ teardown at exit sometimes aborts ("terminate called
    without an active exception", SIGABRT; 2 to 5 runs in 40 of tests/integration/test_weight_sync.py), and the
    learner would read -6 instead of the status this process chose. Nothing is left to write: the error
    line is out, the sockets are closed (``serve``'s finally)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
