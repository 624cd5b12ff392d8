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
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from streamrft.checkpoint.layout import (
    latest_checkpoint,
    rank_file,
    read_meta,
    remove_incomplete,
    rotate,
    step_dir,
    write_json_atomic,
    write_meta,
)
from streamrft.checkpoint.rng import rng_state, set_rng_state
from streamrft.config.checkpoint import validate_checkpoint


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
    def __init__(self, cfg, dist, strategy, accounting, models: dict[str, object] | None = None):
        """``models``: further sharded models with their own ``save(path)/load(path)`` (e.g. the critic),
        each saved in a subfolder of the checkpoint named by its key."""
        validate_checkpoint(cfg)
        self.cfg, self.dist, self.strategy, self.accounting = cfg, dist, strategy, accounting
        self.models = dict(models or {})
        self.stateful: dict[str, object] = {"accounting": accounting}
        self.summary_before: dict[str, float] = {}  # the "before" evaluation, kept in meta.json
        self.saved_step: int | None = None  # the step of the newest checkpoint on disk, as far as we know
        self._snapshot: _Snapshot | None = None

    # ---- resume ----------------------------------------------------------------------------------------
    def resume(self, stateful: dict[str, object]) -> Resumed | None:
        """Load the latest complete checkpoint in output_dir when checkpoint.resume is on (every rank
        calls; a collective). Returns None when starting fresh. Interrupted saves are removed first.

        ``stateful``: further per-rank objects saved from now on (built once the pipeline started)."""
        from streamrft.runtime.distributed import barrier

        self.stateful.update(stateful)
        out, rank = self.cfg.output_dir, self.dist.rank
        latest = latest_checkpoint(out)
        if latest is not None and not self.cfg.checkpoint.resume:
            raise ValueError(f"{latest} holds a checkpoint of an earlier run and checkpoint.resume=false; "
                             "set checkpoint.resume=true to continue it, or choose another output_dir")
        if rank == 0:
            remove_incomplete(out)
        barrier("checkpoint_resume")
        if latest is None:
            return None
        meta = read_meta(latest)
        if meta["world_size"] != self.dist.world_size or meta["seed"] != self.cfg.seed:
            raise ValueError(
                f"{latest} was saved with world_size={meta['world_size']}, seed={meta['seed']}; this run has "
                f"world_size={self.dist.world_size}, seed={self.cfg.seed}; exact resume needs both equal: launch "
                "with the same number of ranks and seed, or set checkpoint.resume=false with a new output_dir")
        self.strategy.load(str(latest))
        for name, model in self.models.items():
            model.load(str(latest / name))
        path = rank_file(latest, rank)
        state = json.loads(path.read_text())
        set_rng_state(state["rng"])
        for name, obj in self.stateful.items():
            if name not in state:
                raise ValueError(f"{path} has no state for {name!r}; was it saved with other algorithm settings?")
            obj.load_state_dict(_from_json(state[name]))
        self.summary_before = meta.get("summary_before", {})
        self.saved_step = meta["step"]
        self._snapshot = _Snapshot(meta["step"], meta["policy_version"], state)
        return Resumed(step=meta["step"], policy_version=meta["policy_version"], path=latest)

    # ---- save ------------------------------------------------------------------------------------------
    def step_done(self, step: int, policy_version: int) -> Path | None:
        """Call right after train step ``step`` (1-based count of completed steps), before anything
        else changes state: snapshots per-rank state; saves every checkpoint.save_every steps and at
        train.max_steps. Returns the checkpoint folder when one was written."""
        self._snapshot = _Snapshot(step, policy_version, self._rank_state())
        every = self.cfg.checkpoint.save_every
        if (every and step % every == 0) or step == self.cfg.train.max_steps:
            return self._save("final" if step == self.cfg.train.max_steps else "periodic")
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
            return None if step < 1 else step_dir(self.cfg.output_dir, step)
        self.strategy.reshard_after_rollout()  # the signal may have come mid-rollout (no-op otherwise)
        path = self._save("signal")
        self._say(f"saved {path} on signal")
        return path

    def _rank_state(self) -> dict:
        state = {name: _to_json(obj.state_dict()) for name, obj in self.stateful.items()}
        state["rng"] = rng_state()
        return state

    def _save(self, reason: str) -> Path:
        snap, rank = self._snapshot, self.dist.rank
        assert snap is not None
        path = step_dir(self.cfg.output_dir, snap.step)
        path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(rank_file(path, rank), snap.rank_state)
        started = time.perf_counter()
        self.strategy.save(str(path))  # a collective: returns on rank 0 once every rank's shards are written
        for name, model in self.models.items():
            model.save(str(path / name))
        if rank == 0:
            self._write_hf_files(path / "hf")
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
                "saved_at": time.time(),
            })
            rotate(self.cfg.output_dir, self.cfg.checkpoint.keep)
        self.saved_step = snap.step
        return path

    def _write_hf_files(self, path: Path) -> None:
        """The model's HF config and the tokenizer, so export needs nothing but the checkpoint."""
        self.strategy.module.config.save_pretrained(str(path))
        self.strategy.tokenizer.save_pretrained(str(path))

    def _say(self, text: str) -> None:
        if self.dist.rank == 0:
            print(f"streamrft: {text}", flush=True)


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
    """steps.jsonl at the start of a run: removed when starting fresh (start_step 0); on resume, kept
    through step ``start_step`` and appended to afterwards (lines of steps that will run again, logged
    after the checkpoint was taken, are dropped so each step appears once)."""
    path = Path(path)
    if start_step == 0 or not path.exists():
        path.unlink(missing_ok=True)
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= start_step]
    if len(kept) != len(lines):
        write_text = "".join(line + "\n" for line in kept)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(write_text)
        tmp.replace(path)
