"""The first step of a StreamRFT benchmark run, taken apart (``gpu_grpo.py``'s first-step table, cold and warm).

Why timestamps in the worker and not phase metrics: ``steps.jsonl`` starts at the first step's rollout; what
comes before it (interpreter start, imports, model load, engine build) and what the first rollout and train
step pay once (static-cache buffers and concatenated weights, CUDA-graph capture with the Triton decode
kernels' compile, the LM head's torch.compile) are not in any metric. ``Stamps`` records wall-clock marks
(``time.time()``, comparable with the parent's launch time) and per-call durations of wrapped functions;
``breakdown`` turns them into seconds (pure: tested on made-up marks).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from typing import Callable

from call_wrap import wrap_calls

# The parent benchmark process puts its time.time() just before starting the worker here.
LAUNCH_ENV = "STREAMRFT_BENCH_LAUNCH_T"


class Stamps:
    """Wall-clock marks (first occurrence wins) and per-call durations of wrapped callables."""

    def __init__(self, sync: Callable[[], None] = lambda: None):
        self.marks: dict[str, float] = {}
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.sync = sync  # torch.cuda.synchronize on a GPU: a duration covers the kernels it queued

    def mark(self, name: str, t: float | None = None) -> None:
        self.marks.setdefault(name, time.time() if t is None else t)

    @contextlib.contextmanager
    def _timed(self, key: str, sync: bool):
        """One call of a wrapped callable: its start and end marks and its duration."""
        if sync:
            self.sync()
        self.mark(f"{key}_start")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                self.sync()
            self.calls[key].append(time.perf_counter() - t0)
            self.mark(f"{key}_end")

    def wrap(self, owner, attr: str, key: str, sync: bool = True) -> None:
        """Replace ``owner.attr`` by a timed version (sync or async function, or method on a class)."""
        wrap_calls(owner, attr, lambda: self._timed(key, sync))

    def to_json(self) -> dict:
        return {"marks": dict(self.marks), "calls": {k: list(v) for k, v in self.calls.items()}}


def _first(calls: dict, key: str) -> float | None:
    v = calls.get(key) or []
    return v[0] if v else None


def _steady(calls: dict, key: str) -> float | None:
    v = calls.get(key) or []
    return statistics.median(v[1:]) if len(v) > 1 else None


def _span(marks: dict, a: str, b: str) -> float | None:
    return marks[b] - marks[a] if a in marks and b in marks else None


def breakdown(marks: dict, calls: dict, first_row: dict) -> dict:
    """Seconds of each part of the first step (None where the run had no such part, e.g. no CUDA graphs).

    ``marks``: ``launch`` (the parent's time before starting the worker), ``main`` (the worker module's first
    line), ``imports_done``, and ``_start``/``_end`` of the wrapped keys; ``calls``: per-call durations of
    ``build_run``, ``build_learner`` (model load: from_pretrained in fp32, shard, move to the device),
    ``build_engine``, ``decoder_init`` (per chunk: concatenated q/k/v and gate/up weights, static KV cache),
    ``prefill``, ``capture`` (CUDA-graph capture; its warm-up step compiles the Triton decode kernels),
    ``rollout`` (waiting for the step's batch), ``train`` (the train step; the first compiles the LM head);
    ``first_row``: the first line of steps.jsonl (phase metrics of the first step)."""
    b = {
        "process_start_s": _span(marks, "launch", "main"),  # interpreter start (fork/exec + site)
        "config_s": _span(marks, "main", "config_loaded"),
        # the compile warm-up child's start, then torch, transformers, streamrft (as `streamrft train` orders them)
        "imports_s": _span(marks, "config_loaded", "imports_done"),
        "dist_init_s": _span(marks, "imports_done", "dist_ready"),  # the process group (one rank)
        "validate_s": _span(marks, "dist_ready", "validated"),  # incl. importing the reward function
        "build_run_s": _first(calls, "build_run"),
        "model_load_s": _first(calls, "build_learner"),
        "engine_build_s": _first(calls, "build_engine"),
        "loop_start_s": _span(marks, "build_run_end", "rollout_start"),  # train_loop's own set-up
        "first_rollout_s": _first(calls, "rollout"),
        "steady_rollout_s": _steady(calls, "rollout"),
        "decoder_init_first_s": _first(calls, "decoder_init"),
        "decoder_init_steady_s": _steady(calls, "decoder_init"),
        "prefill_first_s": _first(calls, "prefill"),
        "prefill_steady_s": _steady(calls, "prefill"),
        "capture_first_s": _first(calls, "capture"),
        "capture_steady_s": _steady(calls, "capture"),
        "first_train_s": _first(calls, "train"),
        "steady_train_s": _steady(calls, "train"),
        "first_compile_s": first_row.get("compile_seconds"),  # Dynamo/Inductor compiles inside the first step
        "first_weight_sync_s": first_row.get("phase/weight_push_seconds"),
        "first_train_to_rollout_s": first_row.get("phase/train_to_rollout_seconds"),
        "first_rollout_to_train_s": first_row.get("phase/rollout_to_train_seconds"),
        "first_step_s": first_row.get("step_seconds"),
        "launch_to_first_step_s": _span(marks, "launch", "train_end"),
    }
    if b["build_run_s"] is not None:
        b["build_other_s"] = b["build_run_s"] - (b["model_load_s"] or 0.0) - (b["engine_build_s"] or 0.0)
    else:
        b["build_other_s"] = None
    for part in ("rollout", "train"):  # what the first one pays once, over a steady one
        f, s = b[f"first_{part}_s"], b[f"steady_{part}_s"]
        b[f"first_{part}_extra_s"] = f - s if f is not None and s is not None else None
    return b


# (column, key) of the first-step table, in the order the parts happen
COLUMNS = [
    ("start", "process_start_s"), ("imports", "imports_s"), ("validate", "validate_s"), ("model", "model_load_s"),
    ("engine", "engine_build_s"), ("build+", "build_other_s"), ("loop", "loop_start_s"),
    ("roll1", "first_rollout_s"), ("rollN", "steady_rollout_s"), ("dec_init1", "decoder_init_first_s"),
    ("capture1", "capture_first_s"), ("captureN", "capture_steady_s"), ("train1", "first_train_s"),
    ("compile1", "first_compile_s"), ("trainN", "steady_train_s"), ("wsync1", "first_weight_sync_s"),
    ("t2r1", "first_train_to_rollout_s"), ("step1", "first_step_s"), ("to_step1", "launch_to_first_step_s"),
]


def _warmup_parts(warm: dict) -> str:
    """Where the compile warm-up child's time went: its imports, its CUDA context (``device``, where reported),
    each setting's compiles (summed, in the order they first ran), then ``running``: its one forward and backward
    outside those compiles (first kernel launches, their autotuning, the step itself) and the backward's part of it
    (after the last compile), where reported; then when it began compiling and when Inductor's compile workers
    were started and ready (seconds from the child's start; compile_warmup.CompileWorkers). ``device`` is what was
    left of making the CUDA context after the imports, where the child began it beside them ("context S beside the
    imports"). E.g.
    " (imports 9.3, device 0.2, context 2.9 beside the imports, compile_layers 6.1, compile_head 2.9, running 3.0 of
    which backward 1.1, compiling at 12.4, workers started at 5.1, workers ready at 8.4)"; "" without its log. (When
    the workers started says how long the child took to import torch and Inductor: they start right after.)"""
    if "compile_log" not in warm:
        return ""
    parts = [f"imports {warm.get('imports_s', 0):.1f}"]
    if "device_s" in warm:
        parts.append(f"device {warm['device_s']:.1f}")
    if warm.get("cuda_preinit") == "ok":  # the CUDA context made beside the imports (streamrft/cuda_preinit.py)
        parts.append(f"context {warm['cuda_preinit_s']:.1f} beside the imports")
    elif "cuda_preinit" in warm:
        parts.append("context not made beside the imports")
    each: dict[str, float] = {}
    for key, seconds in warm["compile_log"]:
        name = key.removeprefix("train.")
        each[name] = each.get(name, 0.0) + seconds
    parts += [f"{k} {v:.1f}" for k, v in each.items()]
    if "seconds" in warm and "compile_seconds" in warm:
        running = f"running {warm['seconds'] - warm['compile_seconds']:.1f}"
        if "backward_s" in warm:  # the part of it after the last compile
            running += f" of which backward {warm['backward_s']:.1f}"
        parts.append(running)
    if "compiling_at_s" in warm:  # points in time from the child's start, not parts
        parts.append(f"compiling at {warm['compiling_at_s']:.1f}")
    if warm.get("compile_pool_started_s") is not None:  # its start, beside the imports still to come
        parts.append(f"workers started at {warm['compile_pool_started_s']:.1f}")
    if warm.get("compile_pool_ready_s") is not None:
        parts.append(f"workers ready at {warm['compile_pool_ready_s']:.1f}")
    return " (" + ", ".join(parts) + ")"


def first_step_table(rows: list[dict]) -> str:
    """One line per StreamRFT run (``first_step`` and ``cache`` from the worker's result): seconds per part."""
    lines = ["first step, seconds (validate: the config check, which imports the learner's modules; roll1/train1: "
             "the first rollout and train step; N: steady median; capture: CUDA-graph capture + Triton decode "
             "compile; compile1: torch.compile's share of the first step (layers, LM head); t2r1: the switch back "
             "to rollout that ends step 1; to_step1: launch to the end of the first train step; warm-up: the "
             "compile warm-up child's outcome, its wall time from its start (its imports, CUDA context, each "
             "setting's graph compiles and its step's running outside them), and how long compile1 waited for it; "
             "kernels: the engine kernel warm-up child's outcome and wall time)",
             f"{'size':6} {'run':22} {'cache':5} " + " ".join(f"{c:>9}" for c, _ in COLUMNS)
             + "  inductor hit/miss  warm-up  kernels"]
    for r in rows:
        fs = r.get("first_step")
        if not fs:
            continue
        cells = " ".join(f"{'-':>9}" if fs.get(k) is None else f"{fs[k]:9.2f}" for _, k in COLUMNS)
        ind = r.get("inductor_cache", {})
        warm = r.get("compile_warmup") or {}
        warm_cell = (f"{warm.get('status', 'not waited')} {warm.get('wall_s', 0):.1f}s{_warmup_parts(warm)}, "
                     f"waited {warm['waited_s']:.1f}s" if warm else "off")
        kernels = r.get("kernel_warmup") or {}
        kernels_cell = f"{kernels['status']} {kernels.get('wall_s', 0):.1f}s" if kernels else "off"
        lines.append(f"{r['size']:6} {r['system']:22} {r.get('cache', '?'):5} {cells}  "
                     f"{ind.get('fxgraph_cache_hit', 0)}/{ind.get('fxgraph_cache_miss', 0)}  {warm_cell}  "
                     f"{kernels_cell}")
    for r in rows:
        if r.get("first_step") and r.get("imports_from_source"):  # streamrft/bytecode.py: why it matters
            lines.append(f"note: {r['size']} {r['system']} compiled {', '.join(r['imports_from_source'])} from "
                         "source (no .pyc: PYTHONDONTWRITEBYTECODE=1 over an install without byte code), in each "
                         "of its processes; its start is slower than a normal install's. Byte-compile the packages "
                         "once first: python -m compileall -q -j 16 SITE_PACKAGES (benchmarks/NOTES.md v28)")
    return "\n".join(lines)
