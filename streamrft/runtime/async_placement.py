"""The learner side of ``rollout.placement=async``: engine processes generate while the learner trains.

    learner rank 0 ──spawns──► engine process 0 … E-1   (streamrft/engine_process.py, runtime/engine_worker.py)
    engine e: Generator → RewardScorer → AdvantageStage → LearnerRouter ──tcp──► LearnerFeed of rank r
    learner rank 0 ──weights, by version (gloo group of rank 0 + engines)──► every engine process

``AsyncLearnerPipeline`` has the driver's pipeline interface (start, launch, take, pause, resume,
stop): the learner ranks run only their LearnerFeed, which completes a step when every engine sent its
``end_of_step``. ``AsyncPhase`` has the PhaseController's: there is no sleep/wake; ``enter_rollout``
publishes the new version's weights (every learner rank drains the full state, a collective; rank 0
encodes the buckets, then broadcasts them from a thread while the next step trains) and keeps the full parameters for the held-out evaluation, which runs on the
learner's own module while the engines generate. Engines admit a group of step k only with weights of version >= k -
rollout.max_staleness, so the learner trains step k while the engines generate steps k+1..k+S.

Failure: a dead engine process (kill -9 included) fails learner rank 0 within a second, naming the
engine rank, its exit status and the tail of its log; the other learner ranks fail at their next
collective's timeout. Nothing is retried: every sample the learner did not train yet is generated again
on resume (checkpoints never hold samples in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import msgspec
import torch

from protocols import Control, ScoredSample
from streamrft.parent_death import child_env
from streamrft.runtime.channels import ChannelReceiver
from streamrft.runtime.feed import LearnerFeed, TrainBatch
from streamrft.runtime.log_warnings import LogWarnings
from streamrft.runtime.phase import agree_on_batch
from streamrft.runtime.stage import StageContext, StageError


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time as ``intervals``."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval sets (each may overlap itself)."""
    a, b = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(hi - lo, 0.0)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class AsyncLearnerPipeline:
    # the module each engine process runs (python -m); benchmarks/longtail.py runs it with its lengths forced
    worker_module = "streamrft.engine_process"

    def __init__(self, cfg, ctx: StageContext, dist, run_id: str | None = None):
        self.cfg, self.ctx, self.dist = cfg, ctx, dist
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.n_engines = cfg.rollout.engine_ranks
        self.feed: LearnerFeed | None = None
        self.stages: list = []  # the learner ranks run only their feed
        self.teacher = None  # the engine processes fetch teacher log-probs
        self.tasks: dict[asyncio.Task, str] = {}
        self.store = None
        self.procs: list[subprocess.Popen] = []
        self.engine_warnings: list[LogWarnings] = []  # each engine log's warnings, echoed here (rank 0)
        self.publisher = None
        self.generated_tokens = 0
        self.engine_busy: list[tuple[float, float]] = []
        self._receiver: ChannelReceiver | None = None

    # ---- the driver's pipeline interface ---------------------------------------------------------------
    async def start(self) -> None:
        """Rendezvous store (learner rank 0 hosts it), then this rank's feed, bound where engines reach it."""
        from streamrft.runtime.distributed import all_reduce_max

        timeout = timedelta(seconds=self.cfg.rollout.stage_timeout_s)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if self.dist.world_size > 1 else "127.0.0.1"
        if self.dist.rank == 0:
            self.store = torch.distributed.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
            port = self.store.port
        else:
            port = 0
        port = int(all_reduce_max(torch.tensor([port]), stage="async_rendezvous").item())
        if self.dist.rank != 0:
            self.store = torch.distributed.TCPStore(host, port, is_master=False, timeout=timeout)
        self.store_host, self.store_port = host, port
        self._receiver = ChannelReceiver("tcp://127.0.0.1:0", self.cfg.rollout.channel_capacity, name="learner_feed",
                                         rank=self.dist.rank, message_type=ScoredSample | Control)
        self.store.set(f"feed/{self.dist.rank}", self._receiver.address)
        self.feed = AsyncFeed(self.ctx, self._receiver, self.cfg.rollout.max_staleness, self.cfg.rollout.stale_policy,
                              senders=self.n_engines, pipeline=self)
        self.stages = [self.feed]

    def stateful(self) -> dict:
        return {}

    def launch(self, start_step: int) -> None:
        """Start the feed's task; learner rank 0 starts the engine processes (they plan from ``start_step``)."""
        task = asyncio.create_task(self.feed.run(), name=f"learner_feed-rank{self.dist.rank}")
        self.tasks[task] = "learner_feed"
        if self.dist.rank == 0:
            self._spawn_engines(start_step)

    def _spawn_engines(self, start_step: int) -> None:
        from streamrft.runtime.weight_sync import WeightPublisher, new_weights_group

        folder = Path(self.cfg.output_dir) / "engines"
        folder.mkdir(parents=True, exist_ok=True)
        if warning := uncapped_share_warning(self._engine_device(0), self.cfg.rollout.engine_memory_fraction):
            warnings.warn(warning)
        config = msgspec.to_builtins(self.cfg)
        for e in range(self.n_engines):
            spec = {"config": config, "engine_rank": e, "engine_ranks": self.n_engines, "learner_ranks": self.dist.world_size,
                    "store_host": self.store_host, "store_port": self.store_port, "run_id": self.run_id,
                    "start_step": start_step, "weights_timeout_s": self.cfg.rollout.stage_timeout_s,
                    "device": self._engine_device(e)}
            path = folder / f"engine{e}.json"
            path.write_text(json.dumps(spec))
            log = open(folder / f"engine{e}.log", "w")
            self.engine_warnings.append(LogWarnings(folder / f"engine{e}.log", f"engine rank {e}"))
            env = child_env(dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
                env.pop(key, None)  # an engine is not a torchrun rank
            self.procs.append(subprocess.Popen([sys.executable, "-m", self.worker_module, str(path)],
                                               stdout=log, stderr=subprocess.STDOUT, env=env))
            log.close()
            (folder / f"engine{e}.pid").write_text(str(self.procs[-1].pid))
        group = new_weights_group(self.store, 0, self.n_engines + 1, self.cfg.rollout.stage_timeout_s)
        self.publisher = WeightPublisher(group, src_rank=0, timeout_s=self.cfg.rollout.stage_timeout_s, rank=0)

    def _engine_device(self, e: int) -> str:
        """CPU engines on a CPU learner; on GPUs, the learner's own device (one GPU, overlapped)."""
        return str(self.dist.device) if self.dist.device.type == "cuda" else "cpu"

    def check_engines(self) -> None:
        """Echo the engines' new warnings; raise naming the engine rank when an engine process has exited
        before the end of the run."""
        for log in self.engine_warnings:
            log.echo_new()
        for e, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                tail = _tail(Path(self.cfg.output_dir) / "engines" / f"engine{e}.log")
                raise StageError(f"engine rank {e} (pid {proc.pid}) {how} while learner rank {self.dist.rank} waited "
                                 f"for its samples; its log ends:\n{tail}")

    async def take(self, step: int, learner_version: int) -> TrainBatch:
        batch = asyncio.create_task(self.feed.take(step, learner_version), name=f"take-rank{self.dist.rank}")
        timeout_s = self.cfg.rollout.stage_timeout_s
        # the wait starts now: a long train step before it (engines held back by the staleness bound) is no hang
        self.feed.last_arrival = max(self.feed.last_arrival, time.monotonic())
        try:
            while not batch.done():
                await asyncio.wait({batch, *self.tasks}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                for task, name in self.tasks.items():
                    if task.done():
                        exc = task.exception() if not task.cancelled() else None
                        raise StageError(f"stage {name} on learner rank {self.dist.rank} stopped: {exc!r}") from exc
                self.check_engines()
                if not batch.done() and time.monotonic() - self.feed.last_arrival > timeout_s:
                    raise StageError(f"learner rank {self.dist.rank}: no samples from the engine processes for "
                                     f"{timeout_s:.0f}s while waiting for step {step + 1} (rollout.stage_timeout_s)")
            return batch.result()
        finally:
            if not batch.done():
                batch.cancel()
                batch.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def pause(self) -> None:
        """Nothing to drain: the engines keep generating while the learner trains."""

    async def resume(self, version: int) -> None:
        self.ctx.rollout_active.set()

    @contextlib.asynccontextmanager
    async def hold(self):
        """Evaluation runs on the learner's module; the engine processes go on generating."""
        yield

    def step_trained(self, step: int) -> None:
        """Nothing to forget on the learner: the engines keep the rollout's bookkeeping."""

    def take_generated_tokens(self) -> int:
        tokens, self.generated_tokens = self.generated_tokens, 0
        return tokens

    def take_dropped(self) -> list:
        return []  # the engine processes settle filtered and failed samples (counted, not streamed here)

    def media_codec(self):
        return None  # media prompts need placement=colocated

    def publish(self, version: int, buckets) -> None:
        """Learner rank 0: send the version's weights to every engine (others just drain ``buckets``)."""
        if self.publisher is None:
            for _ in buckets:
                pass
            return
        self.check_engines()
        # the broadcast runs beside the next train step (gloo on one GPU stages GBs through host memory)
        self.publisher.publish(version, buckets, background=True)

    async def stop(self, timeout_s: float = 30.0) -> None:
        for task in self.tasks:
            task.cancel()
        if self._receiver is not None:
            self._receiver.close()
        if self.tasks:
            done, _ = await asyncio.wait(self.tasks, timeout=timeout_s)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: ChannelClosed at shutdown is expected
        self.tasks.clear()
        if self.publisher is not None:
            try:
                self.publisher.finish()  # "no more versions": each engine process exits
            except Exception:  # an engine already gone; it is killed below
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for log in self.engine_warnings:
            log.echo_new()


class AsyncFeed(LearnerFeed):
    """A LearnerFeed whose samples come from engine processes: it admits each arriving sample into the
    learner's accounting, and takes what an engine settled itself from its ``end_of_step`` report."""

    def __init__(self, ctx, inbox, max_staleness, stale_policy, senders, pipeline: AsyncLearnerPipeline):
        super().__init__(ctx, inbox, max_staleness, stale_policy, senders)
        self.pipeline = pipeline
        self.last_arrival = time.monotonic()

    async def handle(self, header, tensors) -> bool:
        self.last_arrival = time.monotonic()
        if isinstance(header, ScoredSample):
            self.ctx.accounting.admit(1, step=header.completion.step)
        elif isinstance(header, Control) and header.counts:
            self._settle_report(header)
        return await super().handle(header, tensors)

    def _settle_report(self, report: Control) -> None:
        """Counted under the reporting step (the failure policy reads failures per step); with
        max_staleness > 0 a report may include a few samples of the next step."""
        acct, counts, step = self.ctx.accounting, report.counts, report.step
        acct.admit(counts.get("admitted", 0), step=step)
        for key, n in counts.items():
            kind, _, reason = key.partition("/")
            if kind == "filtered":
                acct.filter(reason, n, step=step)
            elif kind == "failed":
                acct.fail(report.first_failures.get(reason, reason), n, step=step)
        self.pipeline.generated_tokens += counts.get("generated_tokens", 0)
        busy = report.busy
        self.pipeline.engine_busy += [(busy[i], busy[i + 1]) for i in range(0, len(busy) - 1, 2)]


class AsyncPhase:
    """The PhaseController's interface for the async placement: no sleep/wake, weights by version."""

    def __init__(self, strategy, pipeline: AsyncLearnerPipeline, all_reduce_sum, learner_engine, metrics=None,
                 bucket_bytes: int = 256 << 20):
        self.strategy, self.pipeline, self.all_reduce_sum = strategy, pipeline, all_reduce_sum
        self.learner_engine = learner_engine  # the evaluation engine on the learner's module: its version moves
        self.metrics, self.bucket_bytes = metrics, bucket_bytes
        self.timings: dict[str, float] = {}
        self.events: list[str] = []
        self.learner_busy: list[tuple[float, float]] = []
        self._train_started: float | None = None
        self.started: float | None = None  # the first version published: the engines start generating

    def batch_ready(self, local_samples: int, stop: bool = False) -> tuple[int, bool]:
        started = time.perf_counter()
        agreed = agree_on_batch(self.all_reduce_sum, local_samples, stop)
        self.timings["decide"] = time.perf_counter() - started
        return agreed

    async def enter_train(self) -> None:
        self._train_started = time.time()
        self.strategy.reshard_after_rollout()
        self.events.append("train")

    async def enter_rollout(self, version: int) -> None:
        if self._train_started is not None:
            self.learner_busy.append((self._train_started, time.time()))
            self._train_started = None
        started = time.perf_counter()
        buckets = self.strategy.full_state_for_engine(self.bucket_bytes)
        await asyncio.to_thread(self.pipeline.publish, version, buckets)
        await self.learner_engine.update_weights([], version)
        self.timings["weight_push"] = time.perf_counter() - started  # on the learner's path: encoding the version
        if self.pipeline.publisher is not None:  # the previous version's broadcast, which ran beside the step
            self.timings["weight_send"] = self.pipeline.publisher.send_seconds
        if self.started is None:
            self.started = time.time()
        # evaluation generates with the learner's module: full parameters kept, so ranks may run different
        # numbers of forwards (as in the colocated rollout)
        self.strategy.unshard_for_rollout()
        self.events.append("weight_push")
        if self.metrics is not None:
            self.metrics.weight_sync_seconds.observe(self.timings["weight_push"])
        await self.pipeline.resume(version)

    def write_timeline(self, path: Path) -> None:
        """The busy intervals behind ``overlap_report`` (wall-clock seconds), for a look at the overlap."""
        path.write_text(json.dumps({"started": self.started, "engine_busy": union(self.pipeline.engine_busy),
                                    "learner_busy": union(self.learner_busy)}))

    def overlap_report(self) -> dict[str, float]:
        """Fractions of the training wall time (first version published → last train step's end) with
        the engines busy, the learner busy, and both."""
        engine, learner = union(self.pipeline.engine_busy), union(self.learner_busy)
        if self.started is None or not learner:
            return {}
        wall = max(learner[-1][1] - self.started, 1e-9)
        return {
            "engine_busy_fraction": sum(b - a for a, b in engine) / wall,
            "learner_busy_fraction": sum(b - a for a, b in learner) / wall,
            "both_busy_fraction": overlap_seconds(engine, learner) / wall,
        }


def uncapped_share_warning(device: str, fraction: float) -> str | None:
    """What to say when engine processes share the learner's GPU with no memory cap (None: nothing to say).
    Both then allocate as they go: the engine sizes each chunk to the memory free when it starts
    (engines/chunk_memory.py), which can leave the learner's next train step out of memory."""
    if not device.startswith("cuda") or fraction > 0:
        return None
    return (f"rollout.placement=async: the engine processes share {device} with the learner and "
            "rollout.engine_memory_fraction=0 caps neither: an engine's chunk can take the memory the learner's "
            "next train step needs; set rollout.engine_memory_fraction (e.g. 0.3, the engine's share)")


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"
