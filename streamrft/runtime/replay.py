"""What each train step took, on disk, and replaying a run's updates from it.

Every train step appends one line per rank to ``output_dir/batches/index-rank{r}.jsonl``: the step, the
learner version, and per trained sample its id and the versions of its tokens (as [version, count]
runs), so an asynchronous run's staleness can be audited after the fact. With
``train.record_batches=true`` the step's whole batch is saved too (``step{N}-rank{r}.safetensors``:
token ids, behaviour log-probs, advantages, teacher log-probs, token versions and each sample's header
as JSON), and ``streamrft replay RUN_DIR`` trains a fresh learner (same config, same initial weights)
on exactly those batches, in order, and checks that every step's loss and grad norm equal the recorded
ones bitwise (``streamrft.replay_command``): the asynchronous run's nondeterminism (which samples arrived when, under which versions)
is all in the batches; what the learner does with them is deterministic (train.deterministic=true).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import torch

from protocols import ScoredSample
from streamrft.runtime.feed import TrainBatch, TrainSample

_FIELDS = ("prompt_ids", "response_ids", "behaviour_logprobs", "advantages", "teacher_logprobs", "token_versions")


class ReplayError(RuntimeError):
    """A run directory cannot be replayed, or its replay differs from the recorded run."""


def _runs(versions: torch.Tensor) -> list[list[int]]:
    """Run-length encoding [[version, count], ...] of a sample's token versions."""
    out: list[list[int]] = []
    for v in versions.tolist():
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def batches_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "batches"


def record_index(output_dir: str | Path, rank: int, batch: TrainBatch) -> None:
    """One line: which samples the step took and the version of every token."""
    folder = batches_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    samples = []
    for s in batch.samples:
        versions = s.token_versions if s.token_versions is not None else torch.full(
            (len(s.response_ids),), s.header.completion.policy_version)
        samples.append([s.header.completion.sample_id, _runs(versions)])
    line = {"step": batch.step + 1, "learner_version": batch.learner_version, "samples": samples,
            "stale": [s.header.completion.sample_id for s in batch.stale]}
    with open(folder / f"index-rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def record_batch(output_dir: str | Path, rank: int, batch: TrainBatch) -> Path:
    """The step's whole batch, for replay (safetensors: tensors concatenated, offsets, headers)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name in _FIELDS:
        rows = [getattr(s, name) for s in batch.samples]
        present = [r is not None for r in rows]
        if not any(present):
            continue
        if not all(present):
            raise ReplayError(f"step {batch.step + 1} rank {rank}: field {name} is set on some samples only")
        tensors[name] = torch.cat(rows) if rows else torch.zeros(0)
        tensors[f"{name}.lengths"] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    headers = [msgspec.json.decode(msgspec.json.encode(s.header)) for s in batch.samples]
    meta = {"step": str(batch.step), "learner_version": str(batch.learner_version), "headers": json.dumps(headers)}
    path = batches_dir(output_dir) / f"step{batch.step + 1:06d}-rank{rank}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def load_batch(run_dir: str | Path, rank: int, step: int) -> TrainBatch:
    """The batch ``record_batch`` saved for ``step`` (0-based) on ``rank``."""
    from safetensors import safe_open

    path = batches_dir(run_dir) / f"step{step + 1:06d}-rank{rank}.safetensors"
    if not path.exists():
        raise ReplayError(f"{path} is missing: was the run made with train.record_batches=true, with this many ranks?")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        data = {k: f.get_tensor(k) for k in f.keys()}
    headers = [msgspec.convert(h, ScoredSample) for h in json.loads(meta["headers"])]
    columns: dict[str, list[torch.Tensor | None]] = {}
    for name in _FIELDS:
        if name in data:
            columns[name] = list(torch.split(data[name], data[f"{name}.lengths"].tolist()))
        else:
            columns[name] = [None] * len(headers)
    samples = [TrainSample(header=h, **{name: columns[name][i] for name in _FIELDS}) for i, h in enumerate(headers)]
    return TrainBatch(step=int(meta["step"]), learner_version=int(meta["learner_version"]), samples=samples)


def recorded_steps(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "steps.jsonl"
    if not path.exists():
        raise ReplayError(f"{path} is missing: RUN_DIR must be a run's output_dir")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(recorded: list[dict], replayed: list[dict], keys=("loss", "grad_norm")) -> list[str]:
    """Every difference between recorded and replayed steps, bit for bit ([] = identical)."""
    diffs = []
    if len(recorded) != len(replayed):
        diffs.append(f"{len(recorded)} recorded steps, {len(replayed)} replayed")
    for rec, rep in zip(recorded, replayed):
        for key in keys:
            if key in rec and float(rec[key]).hex() != float(rep.get(key, float("nan"))).hex():
                diffs.append(f"step {rec['step']}: {key} recorded {rec[key]!r}, replayed {rep.get(key)!r}")
    return diffs
