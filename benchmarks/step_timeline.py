"""A wall-clock timeline of one StreamRFT run, for finding what makes one step slower than another.

``Timeline`` records (kind, label, start, seconds) events against one clock (time.perf_counter, relative
to the timeline's creation): the rollouts and train steps it is told to wrap, every garbage collection
(``gc.callbacks``), and the checkpoint stager's host-memory work (each page-locking call and each slab).
``trace_summary`` reads a torch.profiler Chrome trace and totals the CUDA runtime/driver calls per thread:
a call of another thread that holds the CUDA driver's lock (cudaHostRegister, cudaHostAlloc) shows up
there next to the training thread's slower launches.

Used by benchmarks/gpu_grpo.py (``timeline`` and ``train_traces`` in results.json).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

from call_wrap import wrap_calls


class Timeline:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, str, float, float]] = []
        self._gc_started: dict[int, float] = {}
        self.learner: list[dict] = []  # per train step: its microbatches' and optimizer step's host and GPU seconds
        self.clocks: list[tuple[float, float, float]] = []  # (seconds, SM clock MHz, board watts)
        self.optimizer_parts: list[tuple] = []  # (train step, part, host s, GPU s)
        self.stacks: dict[tuple, int] = {}  # (train step, thread, innermost frames) -> samples
        self.calls: dict[str, list[tuple[float, float]]] = defaultdict(list)  # kind -> (start, end) of each call
        self.loop_cpu: list[float] = []  # per rollout, the event loop thread's CPU seconds (watch_rollout_parts)
        self._stopped = False

    def add(self, kind: str, label: str, start: float, seconds: float) -> None:
        self.events.append((kind, label, round(start - self.t0, 4), round(seconds, 4)))

    def wrap(self, owner, attr: str, kind: str) -> None:
        """Record every call of ``owner.attr`` (sync or async) as one event labelled by its call count."""
        count = [0]

        @contextlib.contextmanager
        def event():
            count[0] += 1
            label, start = str(count[0]), time.perf_counter()
            try:
                yield
            finally:
                self.add(kind, label, start, time.perf_counter() - start)
        wrap_calls(owner, attr, event)

    def count(self, owner, attr: str, kind: str) -> None:
        """Record every call of ``owner.attr`` (sync or async), for calls made hundreds of times a rollout (one per
        sample): ``to_json`` gives one ``kind`` event per burst (calls less than ``BURST_GAP_S`` apart), labelled
        with the burst's call count and total seconds inside the calls."""
        spans = self.calls[kind]

        @contextlib.contextmanager
        def span():
            start = time.perf_counter()
            try:
                yield
            finally:
                spans.append((start, time.perf_counter()))
        wrap_calls(owner, attr, span)

    BURST_GAP_S = 0.2

    def _bursts(self) -> list[tuple[str, str, float, float]]:
        out = []
        for kind, spans in self.calls.items():
            spans = sorted(spans)
            i = 0
            while i < len(spans):
                first, last, inside, j = spans[i][0], spans[i][1], 0.0, i
                while j < len(spans) and spans[j][0] - last <= self.BURST_GAP_S:
                    last, inside, j = max(last, spans[j][1]), inside + spans[j][1] - spans[j][0], j + 1
                out.append((kind, f"{j - i} calls, {inside:.3f} s inside", round(first - self.t0, 4),
                            round(last - first, 4)))
                i = j
        return out

    def watch_rollout_parts(self, pipeline, profile_take: int = 0, profile_dir: Path | None = None) -> None:
        """Where a rollout's seconds go after the decode: the static decoder's set-up, prefill, capture and
        compactions (``decoder_compacted``: a long-tailed chunk's running rows gathered; its graph is a capture), the
        decode's block waits (their last end is the decode's end), then per stage the bursts of per-sample calls
        (generator sends, reward batches, advantage and learner-feed handling). Per ``pipeline.take`` the event
        loop's own CPU seconds (``loop_cpu``: the per-sample tail's work; the engine's GPU waits run in worker
        threads), and with ``profile_take`` = k a cProfile of the k-th take's event loop in ``profile_dir``."""
        import cProfile
        import io
        import pstats

        import streamrft.engines.hf_fast as hf_fast
        from streamrft.runtime.advantage_stage import AdvantageStage
        from streamrft.runtime.feed import LearnerFeed
        from streamrft.runtime.generator import Generator
        from streamrft.runtime.scoring import RewardScorerStage

        for attr in ("__init__", "prefill", "capture", "compacted"):
            self.wrap(hf_fast.StaticDecoder, attr, f"decoder_{attr.strip('_')}")
        self.count(hf_fast._BlockReadback, "wait", "decode_block_waits")
        self.count(Generator, "_send", "generator_sends")
        self.count(RewardScorerStage, "process_batch", "reward_batches")
        self.count(AdvantageStage, "handle", "advantage_handles")
        self.count(LearnerFeed, "handle", "feed_handles")
        @contextlib.contextmanager
        def measured():
            n = len(self.loop_cpu) + 1
            prof = cProfile.Profile() if n == profile_take else None
            cpu = time.thread_time()
            if prof is not None:
                prof.enable()
            try:
                yield
            finally:
                if prof is not None:
                    prof.disable()
                self.loop_cpu.append(round(time.thread_time() - cpu, 4))
                if prof is not None and profile_dir is not None:
                    for key in ("cumulative", "tottime"):
                        text = io.StringIO()
                        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(60)
                        (profile_dir / f"rollout{n}_profile_{key}.txt").write_text(text.getvalue())
        wrap_calls(pipeline, "take", measured)

    def watch_gc(self) -> None:
        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_started[info["generation"]] = time.perf_counter()
            else:
                start = self._gc_started.pop(info["generation"], None)
                # the young generation's collections are many and short: only a slow one is worth a line
                if start is not None and (info["generation"] > 0 or time.perf_counter() - start > 2e-3):
                    self.add("gc", f"gen{info['generation']}", start, time.perf_counter() - start)
        gc.callbacks.append(on_gc)

    def watch_host_staging(self) -> None:
        """The stager's slabs and each page-locking call (checkpoint/pinning.py)."""
        import streamrft.checkpoint.pinning as pinning

        register = pinning.cuda_register

        def timed_register(address: int, nbytes: int):
            start = time.perf_counter()
            try:
                return register(address, nbytes)
            finally:
                self.add("host_register", str(nbytes), start, time.perf_counter() - start)
        pinning.cuda_register = timed_register
        self.wrap(pinning.HostSlab, "__init__", "host_slab")

    def watch_learner_gpu(self, strategy, actor) -> None:
        """Per train step, the GPU seconds of its microbatches' forward+backward and of its optimizer step
        (CUDA events recorded around each call; no synchronization added) next to their host seconds: a slow
        step whose GPU seconds match a fast one's waits on the host."""
        pending: list[tuple[str, float, object, object]] = []
        time_calls(strategy, "forward_backward", "fb", pending)
        time_calls(strategy, "step", "opt", pending)
        train = actor.train_step
        count = [0]

        @functools.wraps(train)
        def resolved(*a, **k):
            count[0] += 1
            out = train(*a, **k)
            sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
            for kind, host_s, ev0, ev1 in pending:
                row = sums[kind]
                row[0] += 1
                row[1] += host_s
                row[2] += gpu_seconds(ev0, ev1)
            span = pending[0][2].elapsed_time(pending[-1][3]) / 1e3 if pending else 0.0
            self.learner.append({"step": count[0], "gpu_span_s": round(span, 4),
                                 **{f"{k}_{name}": round(v, 4) if name != "n" else v for k, row in sums.items()
                                    for name, v in zip(("n", "host_s", "gpu_s"), row)}})
            pending.clear()
            return out
        actor.train_step = resolved

    def watch_optimizer_step(self, strategy, interval_s: float = 0.005) -> None:
        """Inside each ``strategy.step``: the host and GPU seconds of its parts (grad norm, AdamW step, zero_grad;
        not the LR schedule's, whose state dict holds its attributes), and every ``interval_s`` the innermost
        frames of every thread (a sampling profiler: a thread that holds the GIL or the driver while the training
        thread waits shows up beside it)."""
        import sys
        import threading

        state = {"step": 0, "train_thread": None}
        parts: list[tuple[str, float, object, object]] = []

        time_calls(strategy, "grad_norm", "grad_norm", parts)
        time_calls(strategy.optimizer, "step", "adamw", parts)
        time_calls(strategy.optimizer, "zero_grad", "zero_grad", parts)
        step = strategy.step

        @functools.wraps(step)
        def watched(*a, **k):
            state["step"] += 1
            state["train_thread"] = threading.get_ident()
            try:
                return step(*a, **k)
            finally:
                state["train_thread"] = None
                for name, host_s, ev0, ev1 in parts:
                    self.optimizer_parts.append((state["step"], name, round(host_s, 4),
                                                 round(gpu_seconds(ev0, ev1), 4)))
                parts.clear()
        strategy.step = watched

        def frames(frame, depth: int = 5) -> str:
            out = []
            while frame is not None and len(out) < depth:
                code = frame.f_code
                out.append(f"{Path(code.co_filename).name}:{frame.f_lineno}:{code.co_name}")
                frame = frame.f_back
            return " < ".join(out)

        def sample() -> None:
            me = threading.get_ident()
            while not self._stopped:
                time.sleep(interval_s)
                train = state["train_thread"]
                if train is None:
                    continue
                names = {t.ident: t.name for t in threading.enumerate()}
                for tid, frame in sys._current_frames().items():
                    if tid == me:
                        continue
                    who = "TRAIN" if tid == train else names.get(tid, str(tid))
                    key = (state["step"], who, frames(frame))
                    self.stacks[key] = self.stacks.get(key, 0) + 1
        threading.Thread(target=sample, name="timeline-sampler", daemon=True).start()

    def stack_summary(self, top: int = 12) -> dict:
        """Per optimizer step: the most sampled stacks per thread (counts of interval_s samples)."""
        out: dict[str, list] = defaultdict(list)
        for (step, who, stack), n in sorted(self.stacks.items(), key=lambda kv: -kv[1]):
            if len(out[str(step)]) < top:
                out[str(step)].append((who, n, stack))
        return dict(out)

    def watch_gpu_clocks(self, interval_ms: int = 100) -> None:
        """The SM clock (MHz) and board power (W) sampled by nvidia-smi beside the run (a clock that ramps up
        after an idle stretch would slow one step's kernels and not the next one's)."""
        import subprocess
        import threading

        try:
            proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                     f"--loop-ms={interval_ms}"], stdout=subprocess.PIPE, text=True)
        except OSError:
            return
        self._clock_proc = proc

        def read() -> None:
            for line in proc.stdout:
                try:
                    sm, watts = (float(x) for x in line.split(","))
                except ValueError:
                    continue
                self.clocks.append((round(time.perf_counter() - self.t0, 3), sm, watts))
        threading.Thread(target=read, daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        proc = getattr(self, "_clock_proc", None)
        if proc is not None:
            proc.terminate()

    def to_json(self) -> list:
        return sorted(self.events + self._bursts(), key=lambda e: e[2])


def time_calls(owner, attr: str, tag: str, out: list) -> None:
    """Replace ``owner.attr`` by a version that appends (tag, host seconds, event, event) to ``out`` per call: CUDA
    events recorded around the call on a GPU (no synchronization added), None otherwise."""
    import torch

    fn, cuda = getattr(owner, attr), torch.cuda.is_available()

    @functools.wraps(fn)
    def timed(*a, **k):
        start = time.perf_counter()
        ev0 = ev1 = None
        if cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        result = fn(*a, **k)
        if cuda:
            ev1.record()
        out.append((tag, time.perf_counter() - start, ev0, ev1))
        return result
    setattr(owner, attr, timed)


def gpu_seconds(ev0, ev1) -> float:
    """The GPU stream time between two events of ``time_calls`` (0 without CUDA); waits for the second."""
    if ev0 is None:
        return 0.0
    ev1.synchronize()
    return ev0.elapsed_time(ev1) / 1e3


def trace_summary(path: Path, top: int = 30) -> dict:
    """Per thread, the CUDA runtime/driver calls of a Chrome trace: count, total and longest (ms), the
    busiest first; and each thread's share of the window (sum of its top-level CPU ops)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e.get("tid"): e["args"].get("name") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
    calls: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    span = [float("inf"), 0.0]
    for e in events:
        if e.get("ph") != "X":
            continue
        ts, dur = float(e.get("ts", 0)), float(e.get("dur", 0))
        span[0], span[1] = min(span[0], ts), max(span[1], ts + dur)
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            key = (str(names.get(e.get("tid"), e.get("tid"))), e.get("name"))
            row = calls[key]
            row[0] += 1
            row[1] += dur / 1e3
            row[2] = max(row[2], dur / 1e3)
    rows = sorted(((t, n, c, round(s, 2), round(m, 2)) for (t, n), (c, s, m) in calls.items()),
                  key=lambda r: -r[3])[:top]
    return {"window_ms": round((span[1] - span[0]) / 1e3, 1),
            "runtime_calls": [dict(zip(("thread", "call", "count", "total_ms", "max_ms"), r)) for r in rows]}
