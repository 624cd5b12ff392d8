"""Checkpointer: periodic, final and SIGTERM saves, and exact resume from the latest complete checkpoint.

What one checkpoint holds (see layout.py for the files):
- model, optimizer and LR scheduler, sharded with torch.distributed.checkpoint (``Strategy.save/load``);
- per rank: RNG states (torch, python, numpy), the Accounting counters, and every object handed in as
  ``stateful`` (``state_dict()/load_state_dict()`` with JSON-encodable state; e.g. the Generator's
  ``refills_used``; an actor exposing an adaptive KL controller or running statistics joins the same way);
- in meta.json: the step (train steps completed), the engine's policy version to resume with, the world
  size, the seed, and the "before" evaluation (a resumed run reports it instead of evaluating again).

The data position needs no state: the prompts of step ``s`` are a pure function of (seed, s)
(``Generator.plan``, ``EpochOrder``), so resuming at step ``k`` replays exactly what an uninterrupted run
would have done, sampling included (per-sample seeds).

In flight at a step boundary: with rollout.max_staleness > 0, samples of later steps may be admitted
already. They are not saved: the Accounting state leaves them out (``Accounting.state_dict``) and a
resumed run generates them again from their per-sample seeds, so none is trained twice.

SIGTERM: ``step_done`` keeps a snapshot of the cheap per-rank state taken at the boundary, and the model
and optimizer only change inside a train step, so on a signal the last completed step can be saved
even from the middle of the next rollout. Ranks first agree on that step (one all-reduce with
``checkpoint.signal_timeout_s``); when they cannot, nothing is saved and the message says why.

Asynchronous saves (checkpoint.async_save; staging.py, background.py): the train step waits only while the
model, optimizer and scheduler state is copied to reused host buffers; a background thread then writes the
DCP shards (collectives on a gloo group of their own, so they never interleave with the training thread's),
and rank 0 writes meta.json after the last shard write returned, which DCP returns only once every rank's
shards are written and fsynced. At most one save is in flight; the next save, the end of the run and a
signal save wait for it (checkpoint.save_timeout_s), and a failed write raises in the training thread.

Robustness: the resume guard (guard.py) refuses a checkpoint of a run with other training settings; a
checkpoint that does not load is skipped (renamed ``unloadable_step_*``) and the next newest is used;
a save that fails for a full disk or a file-size limit says ENOSPC / EFBIG and the path.

Security: stock torch.distributed.checkpoint unpickles ``.metadata`` and loads non-tensor entries (the
LR scheduler) with ``torch.load(weights_only=False)``; the FSDP2 strategy and `streamrft export` read
through safe_load.py instead (an allow-list unpickler for ``.metadata``, ``weights_only=True`` for the
rest), so a hostile file there is refused, not run. DeepSpeed (train.strategy=deepspeed) loads its own
files with ``torch.load(weights_only=False)``: there anyone who can write ``output_dir`` can run code in
a run that resumes from it. Keep output_dir writable only by the user running the job. Everything
StreamRFT itself writes beside the shards is JSON.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from streamrft.checkpoint.background import BackgroundWriter, CheckpointSaveError
from streamrft.checkpoint.completion import CompletionGate
from streamrft.checkpoint.guard import check_compatible, check_mode, write_config
from streamrft.checkpoint.layout import (
    loadable_checkpoints,
    rank_file,
    read_meta,
    remove_incomplete,
    rotate,
    set_aside,
    step_dir,
    write_json_atomic,
    write_meta,
)
from streamrft.checkpoint.rng import rng_state, set_rng_state
from streamrft.config.base import ConfigError
from streamrft.config.checkpoint import async_save_enabled, validate_checkpoint


@dataclass
class Resumed:
    step: int  # train steps completed: the loop continues with step index ``step``
    policy_version: int  # the engine's policy version at the checkpoint
    path: Path


@dataclass
class _Snapshot:
    step: int
    policy_version: int
    rank_state: dict


class Checkpointer:
    def __init__(self, cfg, dist, strategy, accounting, models: dict[str, object] | None = None, host_idle=None):
        """``models``: further sharded models with their own ``save(path)/load(path)`` (e.g. the critic),
        each saved in a subfolder of the checkpoint named by its key. ``host_idle``: the colocated engine's
        HostIdleWindow (runtime/host_idle.py), or None; async saves' buffers are page-locked while it is open."""
        validate_checkpoint(cfg)
        self.cfg, self.dist, self.strategy, self.accounting = cfg, dist, strategy, accounting
        self.models = dict(models or {})
        self.stateful: dict[str, object] = {"accounting": accounting}
        self.summary_before: dict[str, float] = {}  # the "before" evaluation, kept in meta.json
        self.saved_step: int | None = None  # the step of the newest checkpoint on disk, as far as we know
        self._snapshot: _Snapshot | None = None
        self._background: BackgroundWriter | None = None  # set when checkpoint.async_save is on
        if async_save_enabled(cfg, dist.device.type):
            self._background = BackgroundWriter(dist.rank, cfg.checkpoint.save_timeout_s)
        self._stagers: dict[str, object] = {}  # per saved model: host buffers reused across async saves
        self.host_idle = host_idle  # a HostIdleWindow: the prewarm page-locks only while it is open
        self._group = None  # the gloo process group of the background writes (created at the first one)
        self.stage_seconds: float | None = None  # how long the newest save blocked the training thread
        self.wait_seconds = 0.0  # of which: waiting for the previous background write (a write slower than the steps between saves)
        # The newest save's gate (completion.py): its meta.json is written once the gate is committed (at once
        # without defer_complete; else by commit(), which the training loop calls once the step's steps.jsonl
        # line and trajectories are written), never when it is abandoned.
        self._gate: CompletionGate | None = None
        # Test seam: called as write_hook(point, path) in the background write, point "shards" (before the
        # shards) or "meta" (after every shard, before meta.json): a delay, an error or a crash injected here.
        self.write_hook = None

    @property
    def async_save(self) -> bool:
        return self._background is not None

    # ---- resume ----------------------------------------------------------------------------------------
    def resume(self, stateful: dict[str, object]) -> Resumed | None:
        """Load the newest complete checkpoint in output_dir that loads, as checkpoint.resume allows (every
        rank calls; a collective). Returns None when starting fresh. Interrupted saves are removed first.

        A checkpoint whose files do not read back, or whose load fails on any rank, is skipped (renamed
        ``unloadable_step_*``, with the reason said) and the next newest is tried. A checkpoint of a run
        with other training settings is refused, not skipped (checkpoint/guard.py).

        ``stateful``: further per-rank objects saved from now on (built once the pipeline started)."""
        from streamrft.runtime.distributed import barrier

        self.stateful.update(stateful)
        out = self.cfg.output_dir
        check_mode(self.cfg)
        if self.dist.rank == 0:
            remove_incomplete(out)
        barrier("checkpoint_resume")
        candidates, unreadable = loadable_checkpoints(out)
        skipped = list(unreadable)
        for path, reason in unreadable:
            self._say(f"skipped checkpoint {path}: {reason}")
        for path in candidates:
            meta = read_meta(path)
            check_compatible(path, meta, self.cfg, self.dist.world_size)
            error = self._load_agreed(path, meta)
            if error is None:
                if skipped:
                    self._set_aside(skipped)
                    self._say(f"resumed from {path} (step {meta['step']}) instead of the newer checkpoint(s) above")
                return Resumed(step=meta["step"], policy_version=meta["policy_version"], path=path)
            self._say(f"skipped checkpoint {path}: {error}")
            skipped.append((path, error))
        if skipped:
            raise ConfigError(
                f"no checkpoint in {out}/checkpoints loads: " + "; ".join(f"{p.name}: {r}" for p, r in skipped)
                + "; move them aside to start fresh, or pass a new output_dir")
        return None

    def _load_agreed(self, path: Path, meta: dict) -> str | None:
        """Load ``path`` on every rank; None when every rank loaded it, else this or another rank's reason."""
        import torch
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        from streamrft.runtime.distributed import all_reduce_max

        error = None
        try:
            self.strategy.load(str(path))
            for name, model in self.models.items():
                model.load(str(path / name))
            state = json.loads(rank_file(path, self.dist.rank).read_text())
            for name in self.stateful:
                if name not in state:
                    raise ValueError(f"{rank_file(path, self.dist.rank)} has no state for {name!r}; was it saved "
                                     "with other algorithm settings?")
        except (Exception, CheckpointException) as exc:  # any failure to read this checkpoint: try the next one
            error = f"rank {self.dist.rank}: {_reason(exc)}"
        failed = all_reduce_max(torch.tensor([0.0 if error is None else 1.0]), stage="checkpoint_resume",
                                timeout_s=self.cfg.rollout.stage_timeout_s).item()
        if failed and error is None:
            return "another rank could not load it"
        if error is not None:
            return error
        set_rng_state(state["rng"])
        for name, obj in self.stateful.items():
            obj.load_state_dict(_from_json(state[name]))
        self.summary_before = meta.get("summary_before", {})
        self.saved_step = meta["step"]
        self._snapshot = _Snapshot(meta["step"], meta["policy_version"], state)
        return None

    def _set_aside(self, skipped: list[tuple[Path, str]]) -> None:
        """Rank 0 renames the skipped checkpoints once every rank has decided (they are never resumed
        from again, and the steps they held will be saved afresh)."""
        from streamrft.runtime.distributed import barrier

        barrier("checkpoint_set_aside")
        if self.dist.rank == 0:
            for path, reason in skipped:
                if path.exists():
                    self._say(f"renamed {path} to {set_aside(path, reason).name}")
        barrier("checkpoint_set_aside_done")

    # ---- save ------------------------------------------------------------------------------------------
    def step_done(self, step: int, policy_version: int, defer_complete: bool = False) -> Path | None:
        """Call right after train step ``step`` (1-based count of completed steps), before anything
        else changes state: snapshots per-rank state; saves every checkpoint.save_every steps and at
        train.max_steps. Returns the checkpoint folder when one was written.

        ``defer_complete``: the checkpoint is marked complete (meta.json) only at ``commit()``, which the
        training loop calls after writing the step's records. Otherwise a SIGKILL between the save and the
        steps.jsonl line left a complete checkpoint of a step that was never logged: the resumed run went on
        from the next step and that step's line was lost for good. Killed before ``commit()``, the resume
        starts from the previous checkpoint and the step is trained and logged again, identically."""
        if self._background is not None:
            self._background.check()  # a previous background write that failed ends the run here
        self._snapshot = _Snapshot(step, policy_version, self._rank_state())
        every = self.cfg.checkpoint.save_every
        if (every and step % every == 0) or step == self.cfg.train.max_steps:
            return self._save("final" if step == self.cfg.train.max_steps else "periodic", defer_complete)
        if self._background is not None and not self._stagers:
            # async: allocate the host buffers now, in the background, so the first save only copies
            for name, obj in {"": self.strategy, **self.models}.items():
                self._stager(name).prewarm(obj.state_for_save(), self.host_idle)
        return None

    def save_on_signal(self) -> Path | None:
        """Save the last completed step unless it is on disk already (every rank calls, after the loop
        was cancelled by SIGTERM/SIGINT). Returns the folder, or None with the reason printed."""
        from streamrft.runtime.distributed import CollectiveError, all_reduce_max

        import torch

        step = -1 if self._snapshot is None else self._snapshot.step
        try:
            both = all_reduce_max(torch.tensor([step, -step], dtype=torch.float64), stage="checkpoint_signal",
                                  timeout_s=self.cfg.checkpoint.signal_timeout_s).tolist()
        except CollectiveError as exc:
            self._say(f"no checkpoint saved on signal: ranks did not agree on a step ({exc})")
            return None
        if both[0] != -both[1]:
            self._say(f"no checkpoint saved on signal: ranks stopped after different steps "
                      f"({int(-both[1])}..{int(both[0])})")
            return None
        if step < 1 or step == self.saved_step:
            # saved_step may still be in flight, and uncommitted when the signal cancelled the loop between the
            # save and its step's records: complete it anyway (the state is trained; at most that one line is missing)
            self.commit()
            self.wait()
            return None if step < 1 else step_dir(self.cfg.output_dir, step)
        self.strategy.reshard_after_rollout()  # the signal may have come mid-rollout (no-op otherwise)
        path = self._save("signal")
        self.commit()
        self.wait()  # the process exits next: the signal's checkpoint must be complete first
        self._say(f"saved {path} on signal")
        return path

    def _rank_state(self) -> dict:
        state = {name: _to_json(obj.state_dict()) for name, obj in self.stateful.items()}
        state["rng"] = rng_state()
        return state

    def commit(self) -> None:
        """The records of the newest saved step are written: its checkpoint may be marked complete (rank 0
        writes meta.json now, or the background write does once its shards are on disk)."""
        if self._gate is not None:
            self._gate.commit()

    def _abandon_uncommitted(self) -> None:
        """A deferred save that was never committed (the step failed before its records were written) stays
        incomplete: no meta.json; resume removes the folder. A committed save is unaffected."""
        if self._gate is not None:
            self._gate.abandon()

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is complete; raise its error. Every rank
        calls this before the process ends (the final and the signal save). A save still waiting for
        ``commit()`` is left incomplete."""
        self._abandon_uncommitted()
        if self._background is not None:
            self._background.wait()

    def _save(self, reason: str, defer_complete: bool = False) -> Path:
        snap = self._snapshot
        assert snap is not None
        path = step_dir(self.cfg.output_dir, snap.step)
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        started = time.perf_counter()
        self._abandon_uncommitted()  # the loop commits each save before the next step: none is left normally
        if self._background is not None:
            self._background.wait()  # one save in flight at most (and its error, if it failed, ends the run)
        self.wait_seconds = time.perf_counter() - started
        try:
            if self._background is None:
                self._write(path, snap, reason, defer_complete)
            else:
                self._stage_and_submit(path, snap, reason, started, defer_complete)
        except (Exception, CheckpointException) as exc:
            disk = write_failure(exc, path)
            if disk is None:
                raise
            raise disk from exc
        self.stage_seconds = time.perf_counter() - started
        self.saved_step = snap.step
        return path

    def _stage_and_submit(self, path: Path, snap: _Snapshot, reason: str, started: float,
                          defer_complete: bool = False) -> None:
        """The training thread's part of an async save: the rank file, then the state copied to host memory."""
        group = self._checkpoint_group()  # first: a collective, before anything that may fail on one rank only
        path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(rank_file(path, self.dist.rank), snap.rank_state)
        parts = {"": self.strategy, **self.models}
        staged = {name: self._stager(name).stage(obj.state_for_save()) for name, obj in parts.items()}
        gate = self._gate = self._new_gate(path)  # the background write waits on it before meta.json
        if not defer_complete:
            gate.commit()
        self._background.submit(path, lambda: self._write_staged(path, snap, reason, staged, group, started, gate))

    def _stager(self, name: str):
        from streamrft.checkpoint.staging import HostStager

        return self._stagers.setdefault(name, HostStager(self.dist.rank))

    def _checkpoint_group(self):
        """A gloo group for the background writes' collectives (DCP plans and gathers through it): on the
        default group they could interleave with the training thread's collectives. Its timeout is
        checkpoint.save_timeout_s. Created by every rank at the first async save (all ranks save together)."""
        from datetime import timedelta

        import torch.distributed as tdist

        if self._group is None:
            self._group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.checkpoint.save_timeout_s))
        return self._group

    def _write_staged(self, path: Path, snap: _Snapshot, reason: str, staged: dict, group, started: float,
                      gate: CompletionGate) -> None:
        """The background thread's part: every shard, then (rank 0) meta.json. Errors come out as
        CheckpointSaveError / CheckpointWriteError naming the checkpoint and rank."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self._hook("shards", path)
            for name, state in staged.items():
                # returns once every rank's shards are written and fsynced (DCP gathers the ranks' results)
                target = str(path / name if name else path)
                dcp.save(state, storage_writer=FileSystemWriter(target, thread_count=_WRITE_THREADS),
                         process_group=group)
            self._hook("meta", path)
            if self.dist.rank == 0 and gate.wait():  # False: abandoned; a timeout raises CheckpointSaveError
                self._finish(path, snap, reason, started)
        except CheckpointSaveError:
            raise
        except (Exception, CheckpointException) as exc:
            disk = write_failure(exc, path)
            if disk is not None:
                raise disk from exc
            ranks = sorted(getattr(exc, "failures", {}) or [])
            where = f"rank(s) {', '.join(map(str, ranks))}" if ranks else f"rank {self.dist.rank}"
            missing = _ranks_without_shards(path, self.dist.world_size)  # who did not write (e.g. a dead rank)
            absent = f" (no shard file from rank(s) {', '.join(map(str, missing))})" if missing else ""
            raise CheckpointSaveError(
                f"checkpoint {path}: the background write failed on {where}: {_reason(exc)}{absent}; it has no "
                "meta.json, so the previous complete checkpoint stays the latest") from exc

    def _hook(self, point: str, path: Path) -> None:
        if self.write_hook is not None:
            self.write_hook(point, path)

    def _write(self, path: Path, snap: _Snapshot, reason: str, defer_complete: bool = False) -> None:
        rank = self.dist.rank
        path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(rank_file(path, rank), snap.rank_state)
        started = time.perf_counter()
        self.strategy.save(str(path))  # a collective: returns on rank 0 once every rank's shards are written
        for name, model in self.models.items():
            model.save(str(path / name))
        # rank 0 completes it in the thread that commits: here, or in commit() when deferred
        finish = (lambda: self._finish(path, snap, reason, started)) if rank == 0 else None
        self._gate = self._new_gate(path, on_commit=finish)
        if not defer_complete:
            self._gate.commit()

    def _new_gate(self, path: Path, on_commit=None) -> CompletionGate:
        return CompletionGate(str(path), self.dist.rank, self.cfg.checkpoint.save_timeout_s, on_commit=on_commit)

    def _finish(self, path: Path, snap: _Snapshot, reason: str, started: float) -> None:
        """Rank 0, after every rank's shards: HF files, config, then meta.json (complete), then rotation."""
        self._write_hf_files(path / "hf")
        write_config(path, self.cfg)
        write_meta(path, {
                "step": snap.step,
                "policy_version": snap.policy_version,
                "world_size": self.dist.world_size,
                "seed": self.cfg.seed,
                "reason": reason,
                "model_path": self.cfg.model.path,
                "lora_rank": self.cfg.model.lora_rank,
                "lora_alpha": self.cfg.model.lora_alpha,
                "lora_target_modules": list(self.cfg.model.lora_target_modules),
                "models": sorted(self.models),
                "summary_before": self.summary_before,
            "save_seconds": time.perf_counter() - started,
            "async_save": self._background is not None,
            "saved_at": time.time(),
        })
        rotate(self.cfg.output_dir, self.cfg.checkpoint.keep)

    def _write_hf_files(self, path: Path) -> None:
        """The model's HF config and the tokenizer, so export needs nothing but the checkpoint."""
        self.strategy.module.config.save_pretrained(str(path))
        self.strategy.tokenizer.save_pretrained(str(path))

    def _say(self, text: str) -> None:
        if self.dist.rank == 0:
            print(f"streamrft: {text}", flush=True)


# Files each rank writes in parallel in a background save (DCP splits a rank's tensors over them). One writer
# thread wrote 0.5B's 6 GB of state at ~0.5 GB/s on the H200's disk, longer than a training step.
_WRITE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


def _ranks_without_shards(path: Path, world_size: int) -> list[int]:
    """Ranks with no DCP shard file (``__{rank}_{n}.distcp``) in ``path``: the ones a failed save waited for."""
    return [r for r in range(world_size) if not any(path.glob(f"__{r}_*.distcp"))]


def _reason(exc: BaseException) -> str:
    """One line for why a load failed; DCP's CheckpointException holds the real error per rank."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class CheckpointWriteError(OSError):
    """A checkpoint could not be written because the disk is full or a file-size limit was hit."""


_DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "file too large (a file-size limit, "
                "e.g. `ulimit -f`)", errno.EDQUOT: "disk quota exceeded"}


def write_failure(exc: BaseException, path: Path) -> CheckpointWriteError | None:
    """The disk-full / file-size reading of a failed save, or None when it is something else.

    Python's own writes raise OSError with the errno. torch's C++ writer (inside torch.save and DCP)
    turns the same failure into a RuntimeError such as "unexpected pos 704 vs 598", so for other errors
    the cause is looked up: free space under ``path`` and the process's RLIMIT_FSIZE against the size
    of the files written."""
    code = _errno_in(exc)
    if code is None:
        code = _diagnose(path)
    if code is None:
        return None
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return CheckpointWriteError(code, f"saving checkpoint {path} failed: {errno.errorcode[code]}, "
                                f"{_DISK_ERRNOS[code]} (the save raised {type(exc).__name__}: {said}); free space "
                                "or raise the limit, then resume: the incomplete folder is removed at the next start")


def _errno_in(exc: BaseException | None) -> int | None:
    seen = set()
    while exc is not None and id(exc) not in seen:  # the errno may sit on a wrapped cause
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
            return exc.errno
        for wrapped in getattr(exc, "failures", {}).values():  # DCP's CheckpointException: rank -> (exc, trace)
            code = _errno_in(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
            if code is not None:
                return code
        exc = exc.__cause__ or exc.__context__
    return None


def _diagnose(path: Path) -> int | None:
    import resource

    probe = path if path.exists() else path.parent
    try:
        stat = os.statvfs(probe)
        if stat.f_bavail * stat.f_frsize < 1 << 20:  # less than 1 MiB left
            return errno.ENOSPC
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and path.is_dir():
        largest = max((f.stat().st_size for f in path.rglob("*") if f.is_file()), default=0)
        if largest >= soft:
            return errno.EFBIG
    return None


def _to_json(state: dict) -> dict:
    """Tensors in a state dict as {"tensor": values, "dtype": name} (float64 -> float is exact)."""
    import torch

    return {k: {"tensor": v.tolist(), "dtype": str(v.dtype).removeprefix("torch.")} if isinstance(v, torch.Tensor)
            else v for k, v in state.items()}


def _from_json(state: dict) -> dict:
    import torch

    return {k: torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]))
            if isinstance(v, dict) and set(v) == {"tensor", "dtype"} else v for k, v in state.items()}


def reset_steps_log(path: str | Path, start_step: int) -> None:
    """A per-step JSON Lines log (steps.jsonl, batches/index-rank{r}.jsonl: lines with a 1-based "step") at
    the start of a run: removed when starting fresh (start_step 0); on resume, kept
    through step ``start_step`` and appended to afterwards (lines of steps that will run again, logged
    after the checkpoint was taken, are dropped so each step appears once).

    A torn last line (the disk filled, or the process died, while it was written) is cut off with a
    message naming the file; a bad line elsewhere is an error naming the file and line."""
    path = Path(path)
    if start_step == 0 or not path.exists():
        path.unlink(missing_ok=True)
        return
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError) as exc:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}: not a step record ({type(exc).__name__}: {exc}); "
                                 "remove or fix that line to resume") from None
            print(f"streamrft: {path}: the last line (line {number}) is torn ({line[:60]!r}); cut it off",
                  flush=True)
            continue
        if step <= start_step:
            kept.append(line)
    if len(kept) != len(lines):
        write_text = "".join(line + "\n" for line in kept)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(write_text)
        tmp.replace(path)
