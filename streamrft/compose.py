"""The composition root: build one rank's Run (config → model, engines, learner, scorer, pipeline,
sinks, metrics) and start ``streamrft train``. Everything that knows which concrete engine, strategy,
scorer or placement to build lives here, outside ``streamrft.runtime``, which only drives what it is given.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field

import torch

from streamrft.config import Config, validate_config
from streamrft.runtime.accounting import Accounting
from streamrft.runtime.stage import StageContext


@dataclass
class Run:
    """Everything one rank needs for a training run."""

    cfg: Config
    dist: object
    strategy: object
    reference: object
    engine: object
    eval_engine: object
    scorer: object
    dataset: object
    eval_dataset: object
    pipeline: object
    phase: object
    actor: object
    accounting: Accounting
    metrics: object = None
    loggers: list = field(default_factory=list)
    sinks: list = field(default_factory=list)
    exporter: object = None
    run_id: str = ""
    checkpointer: object = None
    trainable_params: int = 0  # N of the 6·N·tokens FLOPs estimate
    stop_requested: str = ""  # the signal received (every rank stops at the loop's next agreement)
    stop_event: object = None  # asyncio.Event set with stop_requested: it ends the wait for a rollout


def build_learner(cfg: Config, dist):
    """(strategy, reference or None, critic or None, actor update): everything that trains."""
    from streamrft.learner import build_strategy
    from streamrft.learner.actor import ActorUpdate
    from streamrft.learner.reference import FrozenReference
    from streamrft.runtime.distributed import all_reduce_sum

    strategy = build_strategy(cfg.model, cfg.train, dist, total_steps=cfg.train.max_steps)
    reference = None
    if cfg.algorithm.kl_coef > 0:
        reference = FrozenReference(cfg.model.reference_path or cfg.model.path, cfg.model, dist)
    critic = None
    if cfg.model.critic_path:
        from streamrft.learner.critic import Critic

        critic = Critic(cfg.model, cfg.train, cfg.algorithm.value_clip_eps, dist, cfg.train.max_steps)
    return strategy, reference, critic, ActorUpdate(strategy, reference, cfg, all_reduce_sum, critic)


def _preload_compiler_if_used(cfg: Config, dist) -> None:
    """Start importing Inductor now when the learner will compile (learner/compiling.py preload_compiler): the
    decoder layers (train.compile_layers) or, on CUDA, the LM head (train.compile_head)."""
    from streamrft.config.train import compile_head_enabled, compile_layers_enabled

    device = dist.device.type
    if compile_layers_enabled(cfg.train, device) or compile_head_enabled(cfg.train.compile_head, device):
        from streamrft.learner.compiling import preload_compiler

        preload_compiler()


def build_run(cfg: Config, dist) -> Run:
    """Create model, engine, stages and channels for this rank (config already validated)."""
    from streamrft.checkpoint import Checkpointer, set_deterministic
    from streamrft.data import PromptDataset
    from streamrft.engines import build_engine
    from streamrft.rewards.scorer import build_reward_scorer
    from streamrft.runtime.distributed import all_reduce_sum
    from streamrft.runtime.evaluation import greedy_engine_config
    from streamrft.runtime.phase import PhaseController
    from streamrft.runtime.pipeline import Pipeline
    from streamrft.teacher.client import build_teacher_client

    from streamrft.compile_cache import apply_compile_cache

    apply_compile_cache(cfg.compile_cache_dir)  # before anything compiles (the engine's kernels, the LM head)
    torch.manual_seed(cfg.seed)
    set_deterministic(cfg.train.deterministic)
    d = cfg.data
    written = getattr(cfg, "_written", None)  # data.*_field keys the user wrote win over data.format's preset
    dataset = PromptDataset.from_config(d.train_path, d, written_keys=written)
    eval_dataset = PromptDataset.from_config(d.eval_path, d, written_keys=written) if d.eval_path else None
    strategy, reference, critic, actor = build_learner(cfg, dist)
    _preload_compiler_if_used(cfg, dist)
    tokenizer = strategy.tokenizer
    if cfg.rollout.placement == "async":  # engine processes hold their own copies; the learner only evaluates
        engine = eval_engine = build_engine(greedy_engine_config(cfg.engine), strategy.module, tokenizer, dist.device)
    else:
        engine = build_engine(cfg.engine, strategy.module, tokenizer, dist.device, model_path=cfg.model.path)
        eval_engine = engine.with_config(greedy_engine_config(cfg.engine))  # same weights, greedy sampling
    scorer = build_reward_scorer(cfg.reward)
    teacher = build_teacher_client(cfg.teacher, cfg.reward.timeout_s, cfg.reward.retries)
    accounting = Accounting(rank=dist.rank)
    metrics, exporter = _build_metrics(cfg, dist, accounting)
    ctx = StageContext(rank=dist.rank, stage_timeout_s=cfg.rollout.stage_timeout_s, accounting=accounting, fail_fast=cfg.fail_fast, metrics=metrics)
    run_id = uuid.uuid4().hex[:8]
    if cfg.rollout.placement == "async":
        from streamrft.runtime.async_placement import AsyncLearnerPipeline, AsyncPhase

        pipeline = AsyncLearnerPipeline(cfg, ctx, dist, run_id=run_id)
        phase = AsyncPhase(strategy, pipeline, all_reduce_sum, engine, metrics)
    else:
        pipeline = Pipeline(cfg, ctx, dist.world_size, engine, tokenizer, dataset, scorer, teacher, run_id=run_id)
        phase = PhaseController(strategy, engine, all_reduce_sum, metrics, cfg.engine.sleep_level, push_full_weights=cfg.engine.type != "hf",
                                offload=cfg.train.offload_between_phases, admission=pipeline)
    # colocated: the prewarm of async saves page-locks host memory while the engine decodes (runtime/host_idle.py)
    host_idle = None if cfg.rollout.placement == "async" else getattr(engine, "host_idle_window", None)
    checkpointer = Checkpointer(cfg, dist, strategy, accounting, models={"critic": critic} if critic else {},
                                host_idle=host_idle)
    if metrics is not None:
        from streamrft.metrics.probe import probe_pipeline

        metrics.on_scrape(lambda: probe_pipeline(metrics, pipeline, accounting))
    from streamrft.metrics.probe import trainable_parameters

    return Run(cfg, dist, strategy, reference, engine, eval_engine, scorer, dataset, eval_dataset, pipeline, phase, actor, accounting, metrics, _build_loggers(cfg, dist), _build_sinks(cfg, dist, run_id), exporter, run_id, checkpointer, trainable_parameters(strategy.module))


def _build_metrics(cfg, dist, accounting):
    if cfg.metrics.peak_flops < 0 or math.isnan(cfg.metrics.peak_flops):
        raise ValueError(f"metrics.peak_flops={cfg.metrics.peak_flops} must be >= 0 (FLOP/s of one rank; 0 = detect)")
    if cfg.metrics.peak_flops == 0:  # resolved here, where the device is known; 0.0 stays: no mfu (CPU, unknown GPU)
        from streamrft.metrics.probe import detect_peak_flops

        cfg.metrics.peak_flops = detect_peak_flops(dist.device)
    if not cfg.metrics.port:
        return None, None
    from streamrft.metrics.exporter import start_exporter
    from streamrft.metrics.registry import PipelineMetrics

    metrics = PipelineMetrics(rank=dist.rank)
    accounting.metrics = metrics
    server, port = start_exporter(metrics, cfg.metrics.host, cfg.metrics.port + dist.local_rank)
    if dist.rank == 0:
        print(f"streamrft: metrics on http://{cfg.metrics.host}:{port}/metrics (+ local rank on other ranks)", flush=True)
    return metrics, server


def _build_loggers(cfg, dist):
    if not (cfg.metrics.tensorboard or cfg.metrics.wandb):
        return []
    import msgspec

    from streamrft.metrics.loggers import build_loggers

    return build_loggers(cfg.metrics, cfg.output_dir, dist.rank, msgspec.to_builtins(cfg))


def _build_sinks(cfg, dist, run_id):
    if not (cfg.sinks.jsonl or cfg.sinks.parquet or cfg.sinks.zmq_pub):
        return []
    from streamrft.sinks import build_sinks

    return build_sinks(cfg.sinks, run_id, dist.rank)


def train(cfg: Config) -> dict[str, float]:
    """Entry point of `streamrft train`: one call per rank (torchrun starts the ranks)."""
    from streamrft.learner.compile_warmup import start_compile_warmup, stop_compile_warmup
    from streamrft.runtime.distributed import destroy_distributed, init_distributed

    # first: the child compiles the learner's graphs while the checks, the model load and the first rollout run
    start_compile_warmup(cfg)
    try:
        dist = init_distributed(timeout_s=cfg.rollout.stage_timeout_s)
    except BaseException:
        stop_compile_warmup()
        raise
    try:
        validate_config(cfg, dist.world_size)
        from streamrft.checkpoint.guard import check_resume

        check_resume(cfg, dist.world_size)  # checkpoint.resume and the resume guard, before any model load
        run = build_run(cfg, dist)
        from streamrft.runtime.driver import run_with_signals

        return asyncio.run(run_with_signals(run))
    finally:
        stop_compile_warmup()
        destroy_distributed()


