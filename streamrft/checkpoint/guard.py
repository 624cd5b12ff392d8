"""The resume guard: which checkpoint a run resumes from, and whether it may.

Every checkpoint keeps the resolved config it was saved with (``config.json``, every key, defaults
included). A run that would resume compares its own config with it: a difference in a key that
shapes training (algorithm, model, data, rollout, seed, ...) is refused with the list of differences,
because continuing an ``rloo`` run as ``gspo`` (say) silently mixes two experiments. Keys that do
not change what is trained may differ (``RESUME_MAY_CHANGE``): ``train.max_steps`` (to extend a
run), evaluation, logging, metrics, sinks, checkpoint settings and ``output_dir``.

``checkpoint.resume`` decides what an existing checkpoint means (config/checkpoint.py): ``auto``
resumes when there is one, ``never`` refuses an output_dir that holds one (pass a new output_dir
rather than overwrite or mix runs), ``required`` refuses to start without one.

``check_resume`` runs before any model is loaded (compose.train and ``--dry-run``), on files only;
``Checkpointer.resume`` repeats the decision when it loads (it may fall back to an older checkpoint
when the newest does not load, and the fallback is checked the same way).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from streamrft.checkpoint.layout import complete_checkpoints, loadable_checkpoints, read_meta, write_json_atomic
from streamrft.config.base import ConfigError
from streamrft.config.checkpoint import resume_mode

CONFIG_FILE = "config.json"  # in each checkpoint folder: the resolved config of the run that saved it

# Dotted keys (or section prefixes) whose value may differ between a checkpoint and the run resuming it.
RESUME_MAY_CHANGE = (
    "output_dir",
    "train.max_steps",
    "train.eval_every",
    "train.log_every",
    "train.record_batches",
    "data.eval_path",
    "data.eval_size",
    "metrics",
    "sinks",
    "checkpoint",
)


def resolved_config(cfg) -> dict:
    """Every key of the config with its value (defaults included), as JSON types."""
    return msgspec.to_builtins(cfg)


def write_config(path: str | Path, cfg) -> None:
    write_json_atomic(Path(path) / CONFIG_FILE, resolved_config(cfg))


def read_config(path: str | Path) -> dict | None:
    """The saved config of a checkpoint; None for a checkpoint saved before configs were kept."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: cannot read the saved config: {exc}") from None


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_MAY_CHANGE)


def config_diff(saved: dict, current: dict) -> list[str]:
    """``key: old -> new`` for every training-relevant key that differs. A key present on one side only
    (a setting added or removed by a newer StreamRFT version) is not a difference: its value is the
    default the older run ran with."""
    old, new = _flatten(saved), _flatten(current)
    lines = []
    for key in sorted(old.keys() & new.keys()):
        if not _may_change(key) and _normal(old[key]) != _normal(new[key]):
            lines.append(f"{key}: {json.dumps(old[key])} -> {json.dumps(new[key])}")
    return lines


def _normal(value):
    """JSON round trip turns tuples into lists; compare in that form."""
    return json.loads(json.dumps(value))


def check_compatible(path: Path, meta: dict, cfg, world_size: int) -> None:
    """Raise ConfigError when the run ``cfg`` must not continue the checkpoint in ``path``."""
    if meta["world_size"] != world_size or meta["seed"] != cfg.seed:
        raise ConfigError(
            f"{path} was saved with world_size={meta['world_size']}, seed={meta['seed']}; this run has "
            f"world_size={world_size}, seed={cfg.seed}; exact resume needs both equal: launch with the same "
            "number of ranks and seed, or start a new run in another output_dir")
    saved = read_config(path)
    if saved is None:
        return
    diff = config_diff(saved, resolved_config(cfg))
    if diff:
        raise ConfigError(
            f"{path} was saved by a run with other training settings; resuming it with this config would mix "
            "two runs. Differences (checkpoint -> this run):\n  " + "\n  ".join(diff) + "\nRestore those settings "
            "to continue the run, or start a new run in another output_dir (train.max_steps, evaluation, "
            "logging, metrics, sinks and checkpoint settings may change on resume)")


def check_resume(cfg, world_size: int) -> Path | None:
    """The checkpoint this run will resume from (None: start fresh), decided from files only, before
    any model is loaded. ConfigError when checkpoint.resume forbids the situation or the newest
    loadable checkpoint belongs to a run with other training settings."""
    check_mode(cfg)
    candidates, _ = loadable_checkpoints(cfg.output_dir)
    if not candidates:
        return None
    check_compatible(candidates[0], read_meta(candidates[0]), cfg, world_size)
    return candidates[0]


def check_mode(cfg) -> None:
    """checkpoint.resume against what output_dir holds (complete checkpoints, loadable or not)."""
    mode = resume_mode(cfg.checkpoint)
    complete = complete_checkpoints(cfg.output_dir)
    if mode == "required" and not complete:
        raise ConfigError(
            f"checkpoint.resume=required but {Path(cfg.output_dir) / 'checkpoints'} holds no complete "
            "checkpoint; check output_dir, or set checkpoint.resume=auto to start fresh")
    if mode == "never" and complete:
        raise ConfigError(
            f"{complete[-1][1]} holds a checkpoint of an earlier run and checkpoint.resume=never; pass a new "
            "output_dir to start fresh, or set checkpoint.resume=auto to continue that run")
