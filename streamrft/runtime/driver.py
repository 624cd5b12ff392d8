"""The per-rank driver: the train loop over an already-built Run (one screen, phases named).

Building the components (engines, learner, scorer, sinks: the composition root) lives in
``streamrft.compose``; this module only drives them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import time
from pathlib import Path

import torch


log = logging.getLogger("streamrft")
_PEER_STOP = "another rank's signal"  # run.stop_requested of a rank that stops because another rank was signalled


async def train_loop(run) -> dict[str, float]:
    """Resume or evaluate, then for each step: take the step's batch from the long-lived stages →
    decide → train (in a worker thread: the stages keep moving) → checkpoint → push weights; evaluate
    again. A resumed run skips the "before" evaluation and reports the checkpoint's."""
    from streamrft.checkpoint import reset_steps_log
    from streamrft.learner.compiling import compile_seconds
    from streamrft.runtime.replay import batches_dir

    cfg, phase, pipeline = run.cfg, run.phase, run.pipeline
    started = time.perf_counter()
    await pipeline.start()
    resumed = run.checkpointer.resume(_stateful(run))  # None when starting fresh
    start = resumed.step if resumed else 0
    pipeline.launch(start_step=start)
    if run.dist.rank == 0:
        reset_steps_log(Path(cfg.output_dir) / "steps.jsonl", start)
    # the per-rank index of what each step took: steps a resumed run repeats (and a fresh run's) start over
    reset_steps_log(batches_dir(cfg.output_dir) / f"index-rank{run.dist.rank}.jsonl", start)
    await phase.enter_rollout(version=resumed.policy_version if resumed else 0)
    if resumed is None:
        run.checkpointer.summary_before = {f"{k}_before": v for k, v in (await _evaluate_held(run)).items()}
    summary = dict(run.checkpointer.summary_before)
    resumed_from = f"resumed from {resumed.path} at step {start}; " if resumed else ""
    _announce(run, f"{resumed_from}heldout before: {summary}")
    progress = _progress(run, cfg.train.max_steps - start, "train")
    for step in range(start, cfg.train.max_steps):
        step_started, compile_seconds_before = time.perf_counter(), compile_seconds()
        batch = await _take_unless_stopping(run, step)  # step k trains at learner version k
        # one all-reduce decides ROLLOUT → TRAIN, or that every rank stops here (a signal on any rank)
        global_samples, stopping = phase.batch_ready(len(batch) if batch else 0, stop=bool(run.stop_requested))
        if stopping:
            _stop_agreed(run)
        _record(run, batch)
        await phase.enter_train()
        train_started = time.perf_counter()
        stats = await _train_off_loop(run, batch) if global_samples else {}
        stats["train_seconds"] = time.perf_counter() - train_started
        run.accounting.train(len(batch), step=step)
        run.accounting.check(step)
        _check_failures(run, step, batch, progress)  # failed counts printed; too many stop the run
        run.pipeline.step_trained(step)
        saving_started = time.perf_counter()
        # saves every checkpoint.save_every steps; complete (meta.json) only at commit(), after the step's records
        run.checkpointer.step_done(step + 1, policy_version=step + 1, defer_complete=True)
        stats["checkpoint_seconds"] = time.perf_counter() - saving_started  # async saves: the host copy only
        if run.checkpointer.saved_step == step + 1:  # saved now: the part that waited for the previous write
            stats["checkpoint_wait_seconds"] = run.checkpointer.wait_seconds
        await phase.enter_rollout(version=step + 1)  # offload, push weights, unshard, wake, open the gate
        _step_stats(run, batch, stats, step_started, compile_seconds() - compile_seconds_before)
        _log_step(run, step, stats, progress)
        _write_trajectories(run, step, batch)
        run.checkpointer.commit()  # the step is logged: its checkpoint (if it saved one) may be complete now
        # a signal that came during the step: the next take returns at once and the ranks agree to stop there
        if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and step + 1 < cfg.train.max_steps:
            _announce(run, f"step {step + 1}: {await _evaluate_held(run)}", progress)
    progress.close()
    if _any_rank_stopping(run):  # a signal after the last agreement: the final step is saved, skip the evaluation
        _stop_agreed(run)
    summary.update({f"{k}_after": v for k, v in (await _evaluate_held(run)).items()})
    summary.update(steps=cfg.train.max_steps, seconds=time.perf_counter() - started)
    summary.update(run.accounting.summary())
    if cfg.rollout.placement == "async" and run.dist.rank == 0:
        summary.update({f"async_{k}": v for k, v in phase.overlap_report().items()})
        phase.write_timeline(Path(cfg.output_dir) / "async_timeline.json")
    run.checkpointer.wait()  # checkpoint.async_save: the final checkpoint is on disk (or its error raised) first
    return summary


def _record(run, batch) -> None:
    """What this step takes (sample ids, token versions), and with train.record_batches the whole batch."""
    from streamrft.runtime.replay import batches_dir, record_batch, record_index

    record_index(run.cfg.output_dir, run.dist.rank, batch)
    if run.cfg.train.record_batches:
        config = batches_dir(run.cfg.output_dir) / "config.json"
        if run.dist.rank == 0 and not config.exists():
            import msgspec

            config.write_bytes(msgspec.json.encode(run.cfg))
        record_batch(run.cfg.output_dir, run.dist.rank, batch)


async def _evaluate_held(run) -> dict[str, float]:
    """The held-out evaluation with admission held (colocated: it runs on the same module as the
    rollout engine, and two forwards must not interleave on an FSDP module)."""
    from streamrft.runtime.distributed import all_reduce_sum

    async with run.pipeline.hold():
        if run.stop_event is None or run.eval_dataset is None:  # driven without run_with_signals; nothing to stop
            return await _evaluate(run, all_reduce_sum)
        return await _evaluate_unless_stopping(run, all_reduce_sum)


async def _evaluate_unless_stopping(run, all_reduce_sum) -> dict[str, float]:
    """The held-out evaluation, or a stop agreed by every rank: a signal ends this rank's evaluation at once
    (it can last minutes), and the ranks agree in one all-reduce of their stop flags placed before the
    evaluation's own all-reduces, so every rank makes the same collectives whatever it was doing. A rank whose
    evaluation reached the agreement finishes it (a signal after that waits for the next ``batch_ready``);
    a rank that was cancelled before it joins the agreement with its flag set."""
    agreed: list[bool] = []

    def agree() -> None:
        agreed.append(True)
        if _any_rank_stopping(run, stage="heldout_stop_agreement"):
            _stop_agreed(run)  # CancelledError: out of the evaluation, on every rank alike

    def agree_then_reduce(t: torch.Tensor, **kwargs) -> torch.Tensor:
        if not agreed:
            agree()
        return all_reduce_sum(t, **kwargs)

    evaluation = asyncio.ensure_future(_evaluate(run, agree_then_reduce))
    stopped = asyncio.ensure_future(run.stop_event.wait())
    try:
        await asyncio.wait({evaluation, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not evaluation.done() and not agreed:
            evaluation.cancel()
            await asyncio.gather(evaluation, return_exceptions=True)
            if not agreed:  # cancelled before the agreement: join it (this rank's flag is set, so every rank stops)
                agree()
        return await evaluation
    finally:
        stopped.cancel()
        evaluation.cancel()  # a second signal cancelled this wait: the evaluation must not go on alone


async def _train_off_loop(run, batch) -> dict[str, float]:
    """The train step in a worker thread, so the stages (scoring, advantages, the feed) keep moving.
    A signal that arrives meanwhile waits for the next agreement (``_take_unless_stopping``): the weights
    change inside the thread, and a checkpoint must see a whole step or none."""
    return await asyncio.to_thread(run.actor.train_step, batch.samples)


async def _take_unless_stopping(run, step: int):
    """This rank's batch of ``step``, or None once a signal asked the run to stop: the wait for a rollout is
    the one long wait outside the ranks' common collectives, so a signal ends it at once, and the rank goes
    on to the all-reduce that every rank makes next (``batch_ready``) with its stop flag."""
    if run.stop_requested:
        return None
    if run.stop_event is None:  # driven without run_with_signals (tests)
        return await run.pipeline.take(step, learner_version=step)
    take = asyncio.ensure_future(run.pipeline.take(step, learner_version=step))
    stopped = asyncio.ensure_future(run.stop_event.wait())
    try:
        await asyncio.wait({take, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not take.done():
            take.cancel()
            await asyncio.gather(take, return_exceptions=True)
    return None if take.cancelled() else take.result()


def _any_rank_stopping(run, stage: str = "stop_agreement") -> bool:
    """One all-reduce of the stop flags (after the last step, where no ``batch_ready`` follows; in a held-out
    evaluation), with the per-step collectives' timeout: the ranks may reach it as far apart as their last
    step's logging, or their evaluations' lengths."""
    from streamrft.runtime.distributed import all_reduce_max

    flag = torch.tensor([1.0 if run.stop_requested else 0.0])
    return bool(all_reduce_max(flag, stage=stage).item())


def _stop_agreed(run) -> None:
    """Every rank stops at the same point of the loop (so their next collectives, the signal save's, match),
    including a rank that received no signal itself."""
    run.stop_requested = run.stop_requested or _PEER_STOP
    raise asyncio.CancelledError


def _check_failures(run, step: int, batch, progress) -> None:
    """The failure policy (streamrft/runtime/failure_policy.py) on the step's all-reduced counts: rank 0
    prints the failed samples by kind; a source over reward.max_failed_fraction, or a step that trained
    nothing, raises FailurePolicyError on every rank alike."""
    from streamrft.runtime.failure_policy import FailurePolicyError, check_step

    failed, firsts = run.accounting.take_step_failures(step)
    sources = run.scorer.take_step(step)  # per source: scored and failed counts of the step

    def reduce(values):
        return run.actor.all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()

    line, error = check_step(step + 1, run.cfg.reward.max_failed_fraction, len(batch), failed, firsts, sources, reduce)
    if line:
        _announce(run, line, progress)
    if error:
        raise FailurePolicyError(f"rank {run.dist.rank}: {error}")


def _step_stats(run, batch, stats: dict[str, float], step_started: float, compiled_seconds: float) -> None:
    """Add the driver's own per-step values (all reduced over ranks) to the learner's ``stats``:
    rewards, phase timings, throughput, MFU, the step's compile seconds (``compiled_seconds``: this rank's);
    count tokens on the Prometheus counters."""
    from streamrft.metrics.probe import mfu, training_flops
    from streamrft.runtime.distributed import all_reduce_max

    # env_turns: the environment's per-turn rewards of multi-turn episodes, a component beside the sources
    components = [src.name for src in run.cfg.reward.sources] + (["env_turns"] if run.cfg.env.name else [])
    stats.update(_reward_stats(batch, run.actor.all_reduce_sum, components))
    if run.cfg.env.name:  # multi-turn episodes: turns, tool calls / errors / seconds (runtime/env_stats.py)
        from streamrft.runtime.env_stats import env_step_stats

        stats.update(env_step_stats(batch, run.actor.all_reduce_sum))
    stats.update({f"phase/{k}_seconds": v for k, v in run.phase.timings.items()})
    behind = batch.versions_behind()  # per trained sample: learner version - its oldest token's version
    n, total = run.actor.all_reduce_sum(torch.tensor([len(behind), sum(behind)], dtype=torch.float64)).tolist()
    stats["versions_behind_mean"] = total / max(n, 1.0)
    # one collective for both maxima: the most versions behind and the most seconds a rank spent compiling
    local_max = torch.tensor([float(max(behind, default=0)), compiled_seconds])
    stats["versions_behind_max"], stats["compile_seconds"] = all_reduce_max(local_max, stage="step_stats_max").tolist()
    stats["step_seconds"] = seconds = max(time.perf_counter() - step_started, 1e-9)
    generated_here = run.pipeline.take_generated_tokens()
    local = [float(generated_here), float(sum(len(s.prompt_ids) + len(s.response_ids) for s in batch))]
    generated, processed = run.actor.all_reduce_sum(torch.tensor(local)).tolist()
    stats["generated_tokens_per_s"] = generated / seconds
    stats["trained_tokens_per_s"] = stats.get("train_tokens", 0.0) / seconds
    stats["train_flops"] = training_flops(run.trainable_params, processed)
    if run.cfg.metrics.peak_flops > 0:
        stats["mfu"] = mfu(stats["train_flops"], stats["train_seconds"], run.cfg.metrics.peak_flops, run.dist.world_size)
    if run.metrics is not None:
        run.metrics.generated_tokens.inc(generated_here)
        run.metrics.trained_tokens.inc(sum(len(s.response_ids) for s in batch))
        run.metrics.policy_version.set(run.engine.policy_version)


def _progress(run, total: int, desc: str):
    """A console progress bar on rank 0 (plain lines without a TTY); a silent one elsewhere."""
    from streamrft.metrics.progress import Progress

    m = run.cfg.metrics
    return Progress(total, desc, log_every=max(total, 1), log_every_s=m.progress_log_every_s, enabled=m.progress and run.dist.rank == 0)


def _stateful(run) -> dict:
    """Per-rank state a checkpoint keeps beyond the models (see streamrft/checkpoint/manager.py)."""
    objects = {**run.pipeline.stateful(), "kl_ctl": run.actor.kl_ctl}
    if run.actor.reward_norm is not None:
        objects["reward_norm"] = run.actor.reward_norm
    return objects


async def _evaluate(run, all_reduce_sum) -> dict[str, float]:
    if run.eval_dataset is None:
        return {}
    from streamrft.runtime.evaluation import evaluate

    n = min(run.cfg.data.eval_size or len(run.eval_dataset.rows), len(run.eval_dataset.rows))
    with _progress(run, n, "heldout eval") as progress:  # evaluate() is one batched call: the bar moves once
        result = await evaluate(run.eval_engine, run.strategy.tokenizer, run.eval_dataset, run.scorer, run.dist.rank,
                                run.dist.world_size, all_reduce_sum, run.cfg.data.eval_size,
                                media=run.pipeline.media_codec(), chat_template=run.cfg.data.chat_template,
                                system_prompt=run.cfg.data.system_prompt, env=run.cfg.env, model_path=run.cfg.model.path,
                                max_new_tokens=run.cfg.engine.max_new_tokens,
                                call_timeout_s=run.cfg.rollout.stage_timeout_s)
        progress.update(n, **{k: v for k, v in result.items() if isinstance(v, float)})
    # The result under its per-step names, at the step the evaluated policy reached (the engine's policy
    # version: 0 before training, N after N steps, also on resume) in every metrics sink.
    from streamrft.metrics.heldout import before_fields, heldout_scalars, merge_into_step_line

    scalars, step = heldout_scalars(result), int(getattr(run.engine, "policy_version", 0))
    if run.metrics is not None:
        run.metrics.observe_heldout(step, scalars)
    for logger in run.loggers:
        logger.log(step, scalars)
    if run.dist.rank == 0 and scalars:
        if step == 0:  # no step-0 line in steps.jsonl: the first step's line carries it (see metrics/heldout.py)
            run.heldout_before = before_fields(scalars)
        else:
            merge_into_step_line(Path(run.cfg.output_dir) / "steps.jsonl", step, scalars)
    return result


def _reward_stats(batch, all_reduce_sum, components: list[str]) -> dict[str, float]:
    """Mean and std of the trained samples' rewards over all ranks, in total and per component."""
    columns = {"": [s.header.reward for s in batch]}
    for name in components:
        columns[f"/{name}"] = [s.header.reward_components.get(name, 0.0) for s in batch]
    # Two passes in float64 (global means, then squared deviations from them): the one-pass
    # sum(v^2)/n - mean^2 cancels when the rewards share a large offset.
    sums = []
    for values in columns.values():
        sums += [len(values), sum(values)]
    t = all_reduce_sum(torch.tensor(sums, dtype=torch.float64)).tolist()
    means = [t[2 * i + 1] / max(t[2 * i], 1.0) for i in range(len(columns))]
    squares = all_reduce_sum(torch.tensor(
        [sum((v - m) ** 2 for v in values) for values, m in zip(columns.values(), means)], dtype=torch.float64
    )).tolist()
    out = {}
    for i, suffix in enumerate(columns):
        out[f"reward_mean{suffix}"] = means[i]
        out[f"reward_std{suffix}"] = math.sqrt(squares[i] / max(t[2 * i], 1.0))
    return out


def _announce(run, text: str, progress=None) -> None:
    if run.dist.rank == 0:
        progress.write(f"streamrft: {text}") if progress is not None else print(f"streamrft: {text}", flush=True)


def _log_step(run, step: int, stats: dict[str, float], progress) -> None:
    if run.dist.rank == 0:
        # steps.jsonl: one line of reduced metrics per step (what tests and scripts read back).
        path = Path(run.cfg.output_dir) / "steps.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        held = getattr(run, "heldout_before", None) or {}  # set by _evaluate before training
        run.heldout_before = None
        with path.open("a") as f:
            f.write(json.dumps({"step": step + 1, **stats, **held}) + "\n")
    # Step numbers are 1-based in every sink (steps.jsonl, console, Prometheus, TensorBoard, W&B):
    # step N is the N-th completed train step.
    if run.metrics is not None:
        run.metrics.observe_step(step + 1, stats)
    for logger in run.loggers:
        logger.log(step + 1, stats)
    if run.dist.rank == 0 and (step % run.cfg.train.log_every == 0 or step + 1 == run.cfg.train.max_steps):
        keys = ("loss", "reward_mean", "kl", "entropy", "grad_norm", "step_seconds")
        shown = " ".join(f"{k}={stats[k]:.4g}" for k in keys if k in stats)
        progress.write(f"step {step + 1}/{run.cfg.train.max_steps} {shown}")
    progress.update(1, reward=stats.get("reward_mean", math.nan), tok_s=stats.get("generated_tokens_per_s", 0.0))


def _write_trajectories(run, step: int, batch) -> None:
    dropped = run.pipeline.take_dropped()  # taken every step so it never grows
    if not run.sinks:
        return
    from streamrft.runtime.trajectories import trajectory_records

    for record in trajectory_records(run, step, batch, dropped):
        for sink in run.sinks:
            sink.write(record)
    for sink in run.sinks:
        sink.flush()  # readers see whole steps


def _engines(run) -> list:
    """The rollout engine and the evaluation's, once each (the evaluation may use the rollout engine itself)."""
    return list({id(e): e for e in (run.engine, run.eval_engine)}.values())


async def _shutdown(run) -> None:
    await run.pipeline.stop()
    await run.scorer.close()
    if run.pipeline.teacher is not None:
        await run.pipeline.teacher.close()
    for sink in run.sinks:
        sink.close()
    for logger in run.loggers:
        logger.close()
    if run.exporter is not None:
        from streamrft.metrics.exporter import stop_exporter

        # A Prometheus that has been scraping this run gets one more scrape after the final step and
        # held-out evaluation (else the run's last values never reach it), at most final_scrape_timeout_s.
        timeout = run.cfg.metrics.final_scrape_timeout_s
        metrics = run.metrics
        if metrics is not None and timeout > 0 and metrics.scrapes > 0 and not metrics.wait_for_scrape_after_last_update(0):
            _announce(run, f"waiting up to {timeout:g} s for Prometheus to scrape the final values "
                           "(metrics.final_scrape_timeout_s; 0 = don't wait)")
            if not await asyncio.to_thread(metrics.wait_for_scrape_after_last_update, timeout):
                log.warning("rank %d: no Prometheus scrape within metrics.final_scrape_timeout_s=%g s after the "
                            "final step; its values were not scraped", run.dist.rank, timeout)
        stop_exporter(run.exporter)
    for engine in _engines(run):
        engine.close()  # vllm: its shutdown also tears down its own state


async def run_with_signals(run) -> dict[str, float]:
    """Ctrl-C / SIGTERM stop every rank at the same point of the loop (the next agreement, at most one train
    step away), which saves the last completed step; a second signal stops this rank without waiting for the
    others, unsaved.
    Sockets are closed on every exit path."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    run.stop_event = asyncio.Event()
    forced: list[str] = []

    def on_signal(name: str) -> None:
        if run.stop_requested and run.stop_requested != _PEER_STOP:
            forced.append(name)
            main.cancel()
            return
        run.stop_requested = name
        run.stop_event.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        return await train_loop(run)
    except asyncio.CancelledError:
        if run.stop_requested and not forced:
            # The long-lived stages go on after the loop is cancelled: stop them first, so no generate call
            # queues another forward on the module while it is saved; then wait for the forward a cancelled
            # call left running in its worker thread (FSDP swaps parameters during a forward).
            with contextlib.suppress(asyncio.CancelledError):  # a second signal while the stages stop
                await run.pipeline.stop()
            if not forced:
                for engine in _engines(run):  # the evaluation's too: it has its own forward lock
                    engine.quiesce()
                run.checkpointer.save_on_signal()  # the last completed step, unless it is saved already
        if forced:
            raise KeyboardInterrupt(f"streamrft: stopped by a second {forced[0]} on rank {run.dist.rank} "
                                    "without saving; sockets closed") from None
        if run.stop_requested:
            raise KeyboardInterrupt(f"streamrft: stopped by {run.stop_requested} on rank {run.dist.rank}; "
                                    "sockets closed") from None
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await _shutdown(run)
