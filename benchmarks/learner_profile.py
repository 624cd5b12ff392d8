"""Where the learner's train step spends its time: timed steps, then one step under torch.profiler (issue 20).

The learner is built by the project's own code path (``streamrft.compose.build_learner``: the FSDP2 strategy on
a one-rank group, the actor update) with gpu_grpo.py's train settings (``learner_overrides``: bf16, micro-batch
tokens, fused + compiled LM head), and trained on a synthetic batch shaped like the GRPO benchmark's: B
sequences of P prompt + R response tokens (random ids; advantages one random value per sample, as
group_norm gives; behaviour log-probs near -log V, what a random-init model samples with), handed to
``actor.train_step`` as the loop hands it (a list of ``TrainSample``). Per variant, in a fresh subprocess:

1. ``--warmup`` steps (compile), ``--steps`` timed steps (synchronized): step seconds, tokens/s, learner MFU
   (gpu_grpo.py's formula: ``gpu_flops.train_flops`` over the measured bf16 matmul rate), peak GiB;
2. one step under torch.profiler (CPU + CUDA activities), with ``record_function`` ranges installed by this
   benchmark around the phases (``phase/forward``: the strategy's log-prob forward; ``phase/loss``: the policy
   loss; ``phase/h2d``: moving the microbatch; ``phase/optimizer``: clip + AdamW; backward = the rest of
   ``forward_backward``; other = the actor's own work: microbatching, counts). Each kernel is charged to the
   phase and scope (LM head: ``fused_head.PROFILE_RANGE``; FSDP: its ``FSDP::`` ranges) that contain the CPU
   call that launched it, and to a category by its name (``classify``). GPU idle = the step's wall time minus
   the union of kernel intervals: the time the GPU waited for the CPU (launches, syncs).

On a CPU (``--tiny``) the "kernels" are the CPU ops' self times, idle is the time outside any op.

    python benchmarks/learner_profile.py --out /tmp/lp --sizes 0.5b --steps 3 --warmup 2 \\
        --variants "base;mb12k:train.micro_batch_tokens=12288" --report-dir $OUT --trace $OUT
    python benchmarks/learner_profile.py --tiny --steps 2 --warmup 1 --variants "base;mb:train.micro_batch_tokens=64"
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import gzip
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# ---------------------------------------------------------------- kernel categories (pure) ----------
CATEGORIES = ("gemm", "gemm_head", "attn_fwd", "attn_bwd", "head", "elementwise", "optimizer", "fsdp", "memcpy",
              "other")
LABELS = {
    "gemm": "GEMM (decoder)", "gemm_head": "GEMM (LM head)", "attn_fwd": "attention forward",
    "attn_bwd": "attention backward", "head": "LM head, non-GEMM", "elementwise": "elementwise/reduction",
    "optimizer": "optimizer (clip+AdamW)", "fsdp": "FSDP copies/collectives", "memcpy": "memcpy/memset",
    "other": "other",
}
PHASES = ("forward", "loss", "backward", "optimizer", "h2d", "other")
STEP_RANGE = "phase/step"
HEAD_RANGE = "streamrft.lm_head"  # = streamrft.learner.fused_head.PROFILE_RANGE (not imported: pure, no torch)
FSDP_RANGE = "FSDP::"

_ATTN = re.compile(r"flash|fmha|attention|sdpa|attn", re.I)
_ATTN_BWD = re.compile(r"bwd|backward|cutlassb|bprop|dq_dk_dv|convert_dq|dot_do_o", re.I)
# cuBLAS/cuBLASLt (sm90_xmma_gemm_*, nvjet_* on Hopper, splitKreduce), CUTLASS, and the CPU's matmul ops
_GEMM = re.compile(r"gemm|nvjet|cutlass|cublas|xmma|splitkreduce|^aten::(mm|addmm|bmm|baddbmm|_addmm_activation)$",
                   re.I)
# FSDP2 all-gathers parameters and reduce-scatters gradients (an all-reduce is the actor's counts: not FSDP's)
_FSDP = re.compile(r"chunk_cat|split_with_sizes_copy|all_?gather|reduce_?scatter|^fsdp::", re.I)
_MEMCPY = re.compile(r"memcpy|memset", re.I)
_ELEMENTWISE = re.compile(r"at::native::|elementwise|reduce|softmax|norm|^aten::", re.I)


@functools.lru_cache(maxsize=1 << 16)  # a step launches ~10^5 kernels of a few hundred names
def classify(name: str, scope: str = "") -> str:
    """The category of one kernel (GPU) or CPU op by its name and where it was launched from.

    ``scope``: "head" (launched inside the LM head's profiler range), "fsdp" (inside an ``FSDP::`` range),
    "optimizer" (inside the optimizer phase) or "". GEMMs and attention are named by their kernels wherever
    they run (a GEMM inside the head is ``gemm_head``); everything else inside a scope belongs to it.
    Inductor's ``triton_*`` kernels are elementwise/reductions (``triton_tem_*`` are matmul templates), whatever
    op names they carry."""
    n = name.strip()
    low = n.lower()
    triton = low.startswith("triton_")
    if low.startswith("triton_tem") or (not triton and not _ATTN.search(n) and _GEMM.search(n)):
        return "gemm_head" if scope == "head" else "gemm"
    if not triton and _ATTN.search(n):
        return "attn_bwd" if _ATTN_BWD.search(n) else "attn_fwd"
    if scope == "fsdp" or _FSDP.search(n):
        return "fsdp"
    if scope == "optimizer" or "adam" in low:
        return "optimizer"
    if scope == "head":
        return "head"
    if "nccl" in low:  # another collective (the actor's all-reduced counts)
        return "other"
    if _MEMCPY.search(n):
        return "memcpy"
    if triton or _ELEMENTWISE.search(n):
        return "elementwise"
    return "other"


# ---------------------------------------------------------------- intervals (pure) ------------------
def merge_intervals(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint cover of (start, end) intervals (empty or reversed ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def union_length(intervals, lo: float = -math.inf, hi: float = math.inf) -> float:
    """Length of the union of the intervals, clipped to [lo, hi]."""
    return sum(e - s for s, e in merge_intervals((max(s, lo), min(e, hi)) for s, e in intervals))


def intersection_length(a, b) -> float:
    """Length of (union of a) ∩ (union of b)."""
    a, b = merge_intervals(a), merge_intervals(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def gaps(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    """[lo, hi] minus the union of the intervals."""
    out, t = [], lo
    for s, e in merge_intervals((max(s, lo), min(e, hi)) for s, e in intervals):
        if s > t:
            out.append((t, s))
        t = max(t, e)
    return out + ([(t, hi)] if hi > t else [])


# (phase, its range): a time in several ranges belongs to the first (h2d also runs inside forward; loss, h2d and
# forward inside fwd_bwd, whose remainder is the backward); outside all of them it is "other"
_PHASE_ORDER = (("loss", "loss"), ("h2d", "h2d"), ("forward", "forward"), ("optimizer", "optimizer"),
                ("backward", "fwd_bwd"))


def split_by_phase(intervals, phase_ranges: dict[str, list]) -> dict[str, float]:
    """How much of the intervals' union falls in each phase (``_PHASE_ORDER``; ``phase_ranges``: range name
    -> its (start, end) list)."""
    out, acc, before = {}, [], 0.0
    for phase, name in _PHASE_ORDER:
        acc += phase_ranges.get(name, [])
        upto = intersection_length(intervals, acc)
        out[phase] = upto - before
        before = upto
    out["other"] = union_length(intervals) - before
    return out


class Cover:
    """Membership of a time in a union of intervals (bisect over the merged cover)."""

    def __init__(self, intervals):
        merged = merge_intervals(intervals)
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t <= self.ends[i]


def self_times(ops: list[dict]) -> list[tuple[dict, float, bool]]:
    """(op, self time, top level) per CPU op: its duration minus its direct children's on the same thread."""
    by_thread: dict = defaultdict(list)
    for op in ops:
        by_thread[op.get("tid", 0)].append(op)
    out = []
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda o: (o["ts"], -o["dur"]))
        stack: list[list] = []  # [op, end, children's time, top level]
        done = []
        for op in thread_ops:
            while stack and op["ts"] >= stack[-1][1]:
                done.append(stack.pop())
            if stack:
                stack[-1][2] += op["dur"]
            stack.append([op, op["ts"] + op["dur"], 0.0, not stack])
        done += stack
        out += [(o, max(o["dur"] - child, 0.0), top) for o, _, child, top in done]
    return out


# ---------------------------------------------------------------- the profile, analysed (pure) ------
def analyze(events: list[dict], gpu: bool, top: int = 30) -> dict:
    """Tables of one profiled step from its events (dicts: cat, name, ts, dur in us, tid, corr).

    cat as in a chrome trace: user_annotation (record_function ranges), cpu_op, kernel / gpu_memcpy /
    gpu_memset (GPU work), cuda_runtime / cuda_driver (the launches: same ``corr`` as their kernel); ``link``
    of a launch or GPU event: the ``corr`` of the CPU op that launched it (torch's own association)."""
    ranges = [e for e in events if e["cat"] == "user_annotation"]
    steps = [e for e in ranges if e["name"] == STEP_RANGE]
    if not steps:
        raise ValueError(f"no {STEP_RANGE!r} range in the profile: the profiled step was not recorded")
    lo, hi = steps[-1]["ts"], steps[-1]["ts"] + steps[-1]["dur"]

    def cover(pred):
        return Cover((e["ts"], e["ts"] + e["dur"]) for e in ranges if pred(e["name"]))

    phase_ranges = {name: [(e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"] == f"phase/{name}"]
                    for _, name in _PHASE_ORDER}
    phase_cover = [(phase, Cover(phase_ranges[name])) for phase, name in _PHASE_ORDER]
    head, fsdp = cover(lambda n: n.startswith(HEAD_RANGE)), cover(lambda n: n.startswith(FSDP_RANGE))

    def phase_of(t: float) -> str:
        return next((phase for phase, c in phase_cover if t in c), "other")

    if gpu:
        ops = {e["corr"]: e["ts"] for e in events if e["cat"] == "cpu_op" and e.get("corr")}
        launches = {e["corr"]: e for e in events if e["cat"] in ("cuda_runtime", "cuda_driver") and e.get("corr")}
        work = [(e, e["dur"], True) for e in events if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")]
        work = [w for w in work if lo <= w[0]["ts"] <= hi]
        launch_of = {}
        for e, _, _ in work:
            # the launch call (cudaLaunchKernel, cuLaunchKernel for Triton): exact, if it precedes the kernel and
            # names the same CPU op; else that op's start (a Triton kernel's innermost op can be the whole
            # autograd Function, which starts before the ranges inside it)
            call, link = launches.get(e.get("corr")), e.get("link")
            same_op = not link or not call or not call.get("link") or call["link"] == link
            if call is not None and call["ts"] <= e["ts"] and same_op:
                launch_of[id(e)] = call["ts"]
            else:
                op_ts = ops.get(link)
                launch_of[id(e)] = op_ts if op_ts is not None and op_ts <= e["ts"] else None
        linked = sum(v is not None for v in launch_of.values())
    else:
        work = [w for w in self_times([e for e in events if e["cat"] == "cpu_op"]) if lo <= w[0]["ts"] <= hi]
        launch_of = {id(e): e["ts"] for e, _, _ in work}
        linked = len(work)
    cats = {c: {"ms": 0.0, "count": 0, "by_phase": {p: 0.0 for p in PHASES}} for c in CATEGORIES}
    names: dict[str, list] = {}
    for e, dur, _ in work:
        t = launch_of[id(e)]
        t = e["ts"] if t is None else t  # an unlinked kernel: its own start (GPU time lags the launch)
        phase = phase_of(t)
        scope = "head" if t in head else "fsdp" if t in fsdp else "optimizer" if phase == "optimizer" else ""
        cat = classify(e["name"], scope)
        ms = dur / 1e3
        row = cats[cat]
        row["ms"] += ms
        row["count"] += 1
        row["by_phase"][phase] += ms
        nrow = names.setdefault(e["name"], [cat, 0, 0.0])
        nrow[1] += 1
        nrow[2] += ms
    busy_iv = [(e["ts"], e["ts"] + e["dur"]) for e, _, topl in work if topl]
    window_ms = (hi - lo) / 1e3
    busy_ms = union_length(busy_iv, lo, hi) / 1e3
    # the step's wall time, and its idle gaps, by the phase the CPU was in meanwhile
    phase_wall = split_by_phase([(lo, hi)], phase_ranges)
    phase_idle = split_by_phase(gaps(busy_iv, lo, hi), phase_ranges)
    ranked = sorted(names.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "window_ms": window_ms, "busy_ms": busy_ms, "idle_ms": window_ms - busy_ms,
        "kernel_ms": sum(c["ms"] for c in cats.values()), "n_kernels": len(work),
        "linked_fraction": linked / len(work) if work else 0.0, "categories": cats,
        "phases": {p: {"wall_ms": phase_wall[p] / 1e3, "idle_ms": phase_idle[p] / 1e3,
                       "kernel_ms": sum(c["by_phase"][p] for c in cats.values())} for p in PHASES},
        "head_ms": cats["gemm_head"]["ms"] + cats["head"]["ms"],
        "top": [{"name": n, "category": c, "calls": k, "total_ms": ms, "mean_us": 1e3 * ms / k}
                for n, (c, k, ms) in ranked],
    }


# ---------------------------------------------------------------- tables (pure) ---------------------
def _short(name: str, width: int) -> str:
    name = " ".join(name.split())
    return name if len(name) <= width else name[:width - 3] + "..."


def profile_tables(res: dict) -> str:
    """The per-variant tables: headline numbers, time by category x phase (+ idle), phases, top kernels."""
    p = res["profile"]
    unit = "GPU kernel" if res["device"] == "cuda" else "CPU op (self time)"
    steps, warm = (", ".join(f"{t:.3f}" for t in res[k]) for k in ("step_times", "warmup_times"))
    syncs = res.get("sync_sites")
    lines = [
        f"[{res['size']} {res['variant']}] step {res['step_s']:.3f} s (steps {steps}; warm-up {warm} "
        f"({res['cache']} compile cache); profiled {res['profiled_step_s']:.3f} s), {res['tokens_per_s']:.0f} tok/s, "
        f"learner MFU {res['mfu_pct']:.1f} % "
        f"({res['train_tflop']:.1f} TFLOP/step at {res['rate_tflops']:.0f} TFLOP/s: ideal {res['ideal_s']:.3f} s), "
        f"peak {res['peak_gib']:.1f} GiB (resv {res['peak_reserved_gib']:.1f}); B={res['B']} P={res['P']} "
        + (f"R=longtail (mean {res['response_tokens'] / res['B']:.0f}, cap {res['R']}) " if res.get("workload") == "longtail"
           else f"R={res['R']} ")
        + f"micro_batch_tokens={res['micro_batch_tokens']} microbatches={res['microbatches']}",
        f"  {unit} time of the profiled step ({p['window_ms']:.1f} ms wall, {p['n_kernels']} kernels, "
        f"{100 * p['linked_fraction']:.0f} % linked to their launch); % of the step's wall time (streams may overlap)",
        f"  {'category':24} {'ms':>9} {'%step':>6} {'count':>7} " + " ".join(f"{ph:>9}" for ph in PHASES),
    ]
    if res.get("trace"):
        lines.insert(1, f"  trace: {res['trace']}")
    w = p["window_ms"] or 1.0
    for c in CATEGORIES:
        row = p["categories"][c]
        if not row["count"]:
            continue
        lines.append(f"  {LABELS[c]:24} {row['ms']:9.1f} {100 * row['ms'] / w:6.1f} {row['count']:7d} "
                     + " ".join(f"{row['by_phase'][ph]:9.1f}" for ph in PHASES))
    lines.append(f"  {'idle (no kernel running)':24} {p['idle_ms']:9.1f} {100 * p['idle_ms'] / w:6.1f}   "
                 f"(unprofiled step: ~{res['idle_est_ms']:.1f} ms = step - busy)")
    lines.append(f"  {'LM head total':24} {p['head_ms']:9.1f} {100 * p['head_ms'] / w:6.1f}")
    lines.append(f"  {'phase':24} {'wall_ms':>9} {'idle_ms':>9} {'kernel_ms':>9}   (CPU in the phase; GPU idle "
                 "meanwhile; kernels it launched)")
    for ph in PHASES:
        row = p["phases"][ph]
        lines.append(f"  {ph:24} {row['wall_ms']:9.1f} {row['idle_ms']:9.1f} {row['kernel_ms']:9.1f}")
    lines.append(f"  top {len(p['top'])} by total time:")
    lines.append(f"  {'calls':>6} {'total_ms':>9} {'mean_us':>9} {'category':12} name")
    for t in p["top"]:
        lines.append(f"  {t['calls']:6d} {t['total_ms']:9.2f} {t['mean_us']:9.1f} {t['category']:12} "
                     f"{_short(t['name'], 100)}")
    if syncs is not None:
        lines.append(f"  host waits for the GPU in one more step (torch.cuda sync debug mode): "
                     f"{sum(n for _, n in syncs)} at {len(syncs)} lines" + (":" if syncs else ""))
        lines += [f"  {n:6d}  {site}" for site, n in syncs]
    return "\n".join(lines)


SUMMARY_HEAD = (f"{'size':5} {'variant':14} {'step_s':>7} {'tok/s':>8} {'MFU%':>5} {'peak_GiB':>8} {'GEMM_ms':>8} "
                f"{'attn_ms':>8} {'head_ms':>8} {'elem_ms':>8} {'fsdp_ms':>8} {'optim_ms':>8} {'idle_ms':>8} "
                f"{'idle~ms':>8}  overrides")


def summary_table(results: list[dict]) -> str:
    """One line per variant. GEMM = decoder GEMMs; head = the LM head's GEMMs + its other kernels; idle = the
    profiled step's, idle~ = the unprofiled step's estimate (median step time - busy time)."""
    lines = [SUMMARY_HEAD]
    for r in results:
        over = " ".join(r.get("overrides", [])) or "-"
        if "step_s" not in r:
            lines.append(f"{r.get('size', '?'):5} {r.get('variant', '?'):14} FAILED: "
                         f"{_short(r.get('error', 'no result'), 300)}  [{over}]")
            continue
        head = (f"{r['size']:5} {r['variant']:14} {r['step_s']:7.3f} {r['tokens_per_s']:8.0f} {r['mfu_pct']:5.1f} "
                f"{r['peak_gib']:8.1f} ")
        if "profile" not in r:  # timed, but the breakdown failed
            lines.append(head + f"FAILED: {_short(r.get('error', 'no profile'), 250)}  [{over}]")
            continue
        c = r["profile"]["categories"]
        lines.append(
            head + f"{c['gemm']['ms']:8.1f} {c['attn_fwd']['ms'] + c['attn_bwd']['ms']:8.1f} "
            f"{r['profile']['head_ms']:8.1f} {c['elementwise']['ms']:8.1f} {c['fsdp']['ms']:8.1f} "
            f"{c['optimizer']['ms']:8.1f} {r['profile']['idle_ms']:8.1f} {r['idle_est_ms']:8.1f}  {over}")
    return "\n".join(lines)


# ---------------------------------------------------------------- events out of torch.profiler -----
def events_from_kineto(prof) -> list[dict]:
    """The profile's events as plain dicts (the chrome trace's fields), straight from the kineto results
    (no JSON export: a 0.5B step has ~10^5 events)."""
    raw = prof.profiler.kineto_results.events()
    t0 = min((e.start_ns() for e in raw), default=0)
    out = []
    for e in raw:
        cat = e.activity_type()
        gpu = cat in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
        out.append({"cat": cat, "name": e.name(), "ts": (e.start_ns() - t0) / 1e3, "dur": e.duration_ns() / 1e3,
                    "tid": e.device_resource_id() if gpu else e.start_thread_id(), "corr": e.correlation_id(),
                    "link": e.linked_correlation_id()})
    return out


def events_from_chrome(trace: dict) -> list[dict]:
    """The same dicts from an exported chrome trace (``prof.export_chrome_trace``): there a CPU op is known by
    its "External id", which its kernels carry too; a launch and its kernel share "correlation"."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        cat = e.get("cat", "")
        out.append({"cat": cat, "name": e.get("name", ""), "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0)),
                    "tid": e.get("tid", 0),
                    "corr": args.get("External id") if cat == "cpu_op" else args.get("correlation"),
                    "link": args.get("External id") if cat in ("kernel", "gpu_memcpy", "gpu_memset") else None})
    return out


TRACE_LIMIT = 12 * 2**20  # the GPU call returns files of at most 16 MiB each, 64 MiB together


def write_trace(events: list[dict], path: Path, gpu: bool, limit_bytes: int = TRACE_LIMIT) -> str:
    """A gzipped chrome trace of the profiled step (Perfetto / chrome://tracing) of at most ``limit_bytes``:
    the ranges and GPU work with their launches (CPU runs: the CPU ops); if too big, without launches and CPU
    ops; then also without kernels under 20 us (the file's ``otherData`` says which). Returns what was
    written, or why nothing was."""
    levels = [({"cuda_runtime", "cuda_driver"} | ({"cpu_op"} if not gpu else set()), 0.0, "complete"),
              (set(), 0.0, "no launches or CPU ops"), (set(), 20.0, "no launches or CPU ops, kernels >= 20 us")]
    size = 0
    for extra, min_us, what in levels:
        keep = {"user_annotation", "kernel", "gpu_memcpy", "gpu_memset"} | extra
        trace = {"otherData": {"content": what}, "traceEvents": [
            {"ph": "X", "cat": e["cat"], "name": e["name"][:200], "ts": e["ts"], "dur": e["dur"],
             "pid": 1 if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset") else 0, "tid": e["tid"]}
            for e in events if e["cat"] in keep and (e["cat"] == "user_annotation" or e["dur"] >= min_us)]}
        data = gzip.compress(json.dumps(trace).encode(), compresslevel=6)
        size = len(data)
        if size <= limit_bytes:
            path.write_bytes(data)
            return f"{path} ({what}, {size / 2**20:.1f} MiB)"
    return f"not written: {size / 2**20:.1f} MiB even with {levels[-1][2]} (limit {limit_bytes / 2**20:.0f} MiB)"


# ---------------------------------------------------------------- the worker ------------------------
def install_phase_ranges(actor, strategy) -> None:
    """record_function ranges around the phases of a train step (module docstring), on these instances."""
    import streamrft.learner.fsdp2 as fsdp2
    from torch.profiler import record_function

    def ranged(fn, name):
        @functools.wraps(fn)
        def inner(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return inner

    for owner, attr in ((strategy, "forward_backward"), (strategy, "_logprobs"), (strategy, "step"),
                        (actor, "_loss_fn"), (fsdp2, "move_batch")):
        if not callable(getattr(owner, attr, None)):
            raise RuntimeError(f"learner_profile: {type(owner).__name__}.{attr} is gone; the phase ranges of "
                               "install_phase_ranges must follow the learner's code")
    strategy.forward_backward = ranged(strategy.forward_backward, "phase/fwd_bwd")
    strategy._logprobs = ranged(strategy._logprobs, "phase/forward")
    strategy.step = ranged(strategy.step, "phase/optimizer")
    fsdp2.move_batch = ranged(fsdp2.move_batch, "phase/h2d")
    make_loss = actor._loss_fn
    actor._loss_fn = lambda *a, **k: ranged(make_loss(*a, **k), "phase/loss")


def run_worker(size: str, wl: dict, out: Path, variant: str, overrides: list[str], warmup: int, steps: int,
               rate: float, trace_dir: str) -> dict:
    import torch
    from transformers import AutoConfig

    import streamrft.compose as compose
    from gpu_flops import shape_of, train_flops
    from gpu_grpo import learner_overrides, write_reward_config
    from streamrft.checkpoint import set_deterministic
    from streamrft.compile_cache import apply_compile_cache
    from streamrft.config import load_config, validate_config
    from streamrft.learner.synthetic import synthetic_batch
    from streamrft.runtime.distributed import init_distributed

    cuda = torch.cuda.is_available()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    cache_dir = out / "compile_cache"  # shared by the call's variants: the first compiles cold
    cache = "warm" if cache_dir.is_dir() and any(files for _, _, files in os.walk(cache_dir)) else "cold"
    cfg_path = out / "cfg_profile.yaml"
    write_reward_config(cfg_path)
    cfg = load_config(cfg_path, [f"output_dir={out / f'run_{size}_{variant}'}", f"model.path={out / f'model_{size}'}",
                                 f"data.train_path={out / f'data_{size}.jsonl'}", "data.eval_path=",
                                 f"train.max_steps={warmup + steps + 1}", *learner_overrides(wl),
                                 f"compile_cache_dir={cache_dir}", *overrides])
    dist = init_distributed()
    validate_config(cfg, dist.world_size)
    apply_compile_cache(cfg.compile_cache_dir)  # as compose.build_run: before anything compiles
    torch.manual_seed(cfg.seed)
    set_deterministic(cfg.train.deterministic)
    t0 = time.perf_counter()
    strategy, _reference, _critic, actor = compose.build_learner(cfg, dist)
    build_s = time.perf_counter() - t0
    B, P, R = wl["prompts"] * wl["samples"], wl["prompt_len"], wl["new"]
    # long-tailed: the lengths gpu_grpo's step 1 generates (the same seeds), so the batch pads and packs alike
    lengths = wl["shape"].step_lengths(cfg.seed, 1, wl["prompts"], wl["samples"]) if wl["kind"] == "longtail" else [R] * B
    vocab = AutoConfig.from_pretrained(str(out / f"model_{size}")).vocab_size
    batch = synthetic_batch(B, P, lengths, vocab, wl["samples"], cfg.seed)
    install_phase_ranges(actor, strategy)

    def timed_step() -> float:
        sync()
        t = time.perf_counter()
        actor.train_step(batch)
        sync()
        return time.perf_counter() - t

    warm_times = [timed_step() for _ in range(warmup)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [timed_step() for _ in range(steps)]
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False) as prof:
        with record_function(STEP_RANGE):
            t = time.perf_counter()
            actor.train_step(batch)
            sync()
            profiled_s = time.perf_counter() - t
    shape = shape_of(AutoConfig.from_pretrained(str(out / f"model_{size}")))
    tflop = sum(train_flops(shape, n, P, r) for r, n in collections.Counter(lengths).items()) / 1e12
    step_s = statistics.median(times)
    res = {
        "size": size, "variant": variant, "overrides": overrides, "device": "cuda" if cuda else "cpu",
        "cache": cache, "B": B, "P": P, "R": R, "workload": wl["kind"], "response_tokens": sum(lengths),
        "micro_batch_tokens": cfg.train.micro_batch_tokens,
        "microbatches": len(actor._microbatches(batch)), "build_s": build_s, "warmup_times": warm_times,
        "step_times": times, "step_s": step_s, "profiled_step_s": profiled_s,
        "tokens_per_s": (B * P + sum(lengths)) / step_s, "response_tokens_per_s": sum(lengths) / step_s,
        "train_tflop": tflop, "rate_tflops": rate / 1e12, "ideal_s": tflop * 1e12 / rate,
        "mfu_pct": 100 * tflop * 1e12 / (step_s * rate),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
    }
    if cuda:  # one more step, unprofiled: where it makes the host wait for the GPU
        try:
            res["sync_sites"] = sync_sites(lambda: actor.train_step(batch))
        except Exception as exc:  # noqa: BLE001 - the timings stand; the table says the sites are missing
            res["sync_sites"] = [[f"not found ({type(exc).__name__}: {exc})", 0]]
    t = time.perf_counter()
    try:  # a failed breakdown keeps the timings above (the variant still counts as failed: exit 1)
        events = profile_events(prof, out)
        if cuda and not any(e["cat"] == "kernel" for e in events):
            raise RuntimeError("the CUDA profile has no kernel events (CUPTI unavailable to this process?)")
        res["profile"] = analyze(events, gpu=cuda)
        # the profiler slows launches, not kernels: the unprofiled step's idle is about its time minus busy time
        res["idle_est_ms"] = max(1e3 * step_s - res["profile"]["busy_ms"], 0.0)
        if trace_dir:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            res["trace"] = write_trace(events, Path(trace_dir) / f"trace_{size}_{variant}.json.gz", cuda)
    except Exception as exc:  # noqa: BLE001 - named in the summary
        import traceback

        traceback.print_exc()
        res["error"] = f"profile breakdown: {type(exc).__name__}: {exc}"
    res["analyze_s"] = time.perf_counter() - t
    return res


def sync_sites(step: Callable[[], object], top: int = 15) -> list[list]:
    """Where ``step`` makes the host wait for the GPU (``.item()``, a device-to-host copy, ``nonzero``...): run
    under ``torch.cuda.set_sync_debug_mode("warn")``, each warning counted at the Python line that caused it.
    [[file:line, count], ...], most first; a sync inside the step's loop over microbatches drains the GPU's
    queue once per microbatch, so the host can no longer run ahead of it."""
    import warnings

    import torch

    counts: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            counts[f"{w.filename.split('site-packages/')[-1]}:{w.lineno}"] += 1
    return [[site, n] for site, n in counts.most_common(top)]


def profile_events(prof, scratch: Path) -> list[dict]:
    """``events_from_kineto``; where this torch's kineto results lack a method it calls, the exported chrome
    trace instead (slower: a JSON file of the whole step)."""
    try:
        return events_from_kineto(prof)
    except (AttributeError, TypeError) as exc:
        print(f"learner_profile: kineto events unreadable ({type(exc).__name__}: {exc}); parsing the chrome "
              "trace instead", flush=True)
    path = scratch / "profile_trace.json"
    prof.export_chrome_trace(str(path))
    try:
        return events_from_chrome(json.loads(path.read_text()))
    finally:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------- the parent ------------------------
DEFAULT_RATE = 7.9e14  # bf16 matmul FLOP/s when not measured (gpu_grpo.py's default; the CPU runs use it too)


def write_report(results: list[dict], folders: list[Path]) -> str:
    text = "\n\n".join([summary_table(results)] + [profile_tables(r) for r in results if "profile" in r])
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(results, indent=1))
        (folder / "tables.txt").write_text(text + "\n")
    return text


def main() -> int:
    from bench_variants import parse_variants, worker_result
    from gpu_grpo import SHAPES, tiny_size, workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/learner_profile",
                    help="work dir: models, compile cache, per-variant results")
    ap.add_argument("--sizes", default="0.5b", help="comma-separated: 0.5b, 1.5b (--tiny: the tiny shape)")
    ap.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU dry run)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile)")
    ap.add_argument("--variants", default="", help='"name:key=value,...;name2:..." (train.*/model.* overrides), '
                                                   "each in its own subprocess; default: one run, no overrides")
    ap.add_argument("--report-dir", default="", help="also write results.json and tables.txt here after each variant")
    ap.add_argument("--trace", default="", help="write a gzipped chrome trace of each profiled step into this dir")
    ap.add_argument("--workload", choices=["fixed", "longtail"], default="fixed",
                    help="fixed: every response R tokens; longtail: gpu_grpo's log-normal lengths (median 512, cap 4096)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per variant (its subprocess is killed after)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE, help=argparse.SUPPRESS)
    a = ap.parse_args()
    out = Path(a.out)
    if a.worker:
        overrides = json.loads(a.overrides)
        try:
            res = run_worker(a.size, workload(a.tiny, a.workload, a.size), out, a.variant, overrides, a.warmup,
                             a.steps, a.rate, a.trace)
        except Exception as exc:  # noqa: BLE001 - reported in the summary; the parent exits 1
            import traceback

            traceback.print_exc()
            res = {"size": a.size, "variant": a.variant, "overrides": overrides,
                   "error": f"{type(exc).__name__}: {exc}"}
        (out / f"res_{a.size}_{a.variant}.json").write_text(json.dumps(res))
        if "profile" in res:
            print(profile_tables(res), flush=True)
        return 0 if "error" not in res else 1

    # every flag and override is checked before a model is built or a GPU touched
    if a.steps < 1 or a.warmup < 0:
        raise SystemExit(f"--steps {a.steps} must be >= 1 and --warmup {a.warmup} >= 0")
    variants = parse_variants(a.variants) if a.variants else [("base", [])]
    sizes = list(dict.fromkeys(tiny_size(s) for s in a.sizes.split(","))) if a.tiny else a.sizes.split(",")
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--sizes: {unknown} not in {sorted(set(SHAPES) - {'tiny', 'tiny7b'})}")
    from gpu_grpo import learner_overrides, write_reward_config
    from streamrft.config import load_config, validate_config

    out.mkdir(parents=True, exist_ok=True)
    write_reward_config(out / "cfg_profile.yaml")
    for name, over in variants:
        try:
            cfg = load_config(out / "cfg_profile.yaml", learner_overrides(workload(a.tiny, a.workload, sizes[0])) + over)
            validate_config(cfg, 1, check_paths=False)
        except Exception as exc:  # noqa: BLE001 - any config error, named
            raise SystemExit(f"--variants: variant {name!r} ({' '.join(over) or 'no overrides'}): {exc}") from None

    import torch

    from gpu_grpo import build_model, measure_ceilings_safe

    shutil.rmtree(out / "compile_cache", ignore_errors=True)  # the first variant compiles cold, the others warm
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rate = DEFAULT_RATE
    if device == "cuda":
        rate = measure_ceilings_safe()["bf16_flops_per_s"]
        print(f"bf16 matmul rate {rate / 1e12:.0f} TFLOP/s", flush=True)
    folders = [out] + ([Path(a.report_dir)] if a.report_dir else [])
    results: list[dict] = []
    for size in sizes:
        wl = workload(a.tiny, a.workload, size)
        t0 = time.perf_counter()
        build_model(size, wl, out, device)
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"[{size}] model built in {time.perf_counter() - t0:.1f} s", flush=True)
        for name, over in variants:
            cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--size", size, "--variant", name,
                   "--overrides", json.dumps(over), "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--rate", repr(rate), "--trace", a.trace, "--workload", a.workload] + (["--tiny"] if a.tiny else [])
            t0 = time.perf_counter()
            res = worker_result(cmd, out / f"res_{size}_{name}.json", a.timeout)
            res.setdefault("size", size)
            res.setdefault("variant", name)
            res.setdefault("overrides", over)
            results.append(res)
            print(f"[{size}] {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
            text = write_report(results, folders)
    print("\n==== SUMMARY ====")
    print(text)
    failed = [f"{r['size']}/{r['variant']}" for r in results if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
