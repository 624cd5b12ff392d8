"""Per-step scalar loggers: TensorBoard and Weights & Biases.

Both take the same ``scalars`` dict as :meth:`PipelineMetrics.observe_step` and use its keys as
tags unchanged, so ``loss`` is ``loss`` in Prometheus (``streamrft_loss``), TensorBoard and W&B.
Only rank 0 logs to them (the scalars are already reduced across ranks by then; N copies of one
curve would only cost disk and W&B quota); every rank still has its own Prometheus exporter.

Config dicts are scrubbed with :func:`redact_secrets` before they are written anywhere.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the config tree is only a type here; importing it would load every section
    from streamrft.config.metrics import MetricsConfig

REDACTED = "<redacted>"
# A key that names a credential: the whole key or its last _/-/. separated part.
_SECRET_KEY = re.compile(
    r"(^|[_.\-])(api[_\-]?key|apikey|token|secret|secret[_\-]?key|password|passwd|credentials?|"
    r"private[_\-]?key|auth|authorization|access[_\-]?key)$",
    re.IGNORECASE,
)


def _secret_env_values() -> set[str]:
    """Values of environment variables whose names look like credentials (WANDB_API_KEY, HF_TOKEN, ...)."""
    return {v for k, v in os.environ.items() if _SECRET_KEY.search(k) and len(v) >= 8}


def redact_secrets(value: Any, _secrets: set[str] | None = None) -> Any:
    """A deep copy of ``value`` in which credential-like keys, and any string equal to (or
    containing) the value of a credential-like environment variable, are replaced by ``<redacted>``.
    """
    secrets = _secret_env_values() if _secrets is None else _secrets
    if isinstance(value, Mapping):
        return {
            k: REDACTED if _SECRET_KEY.search(str(k)) else redact_secrets(v, secrets) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v, secrets) for v in value]
    if isinstance(value, str) and any(s in value for s in secrets):
        return REDACTED
    return value


class ScalarLogger(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """Event files under ``log_dir``; the config (scrubbed) goes in once as a text summary."""

    def __init__(self, log_dir: str | os.PathLike, config: Mapping[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter  # heavy: only when TensorBoard is on

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        if config is not None:
            text = json.dumps(redact_secrets(config), indent=2, sort_keys=True, default=str)
            self._writer.add_text("config", f"```\n{text}\n```", global_step=0)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, float(value), global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbLogger:
    """A W&B run (``mode="offline"`` by default: no network; ``wandb sync`` uploads it later)."""

    def __init__(self, project: str, mode: str, run_dir: str | os.PathLike, config: Mapping[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "metrics.wandb=true needs the wandb package: pip install 'streamrft[wandb]', "
                "or set metrics.wandb=false"
            ) from None
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            mode=mode,
            dir=str(run_dir),
            config=redact_secrets(dict(config)),
            # Keep credentials and the machine's environment out of the run's files.
            settings=wandb.Settings(
                console="off", save_code=False, disable_git=True, x_disable_meta=True, x_disable_stats=True
            ),
            reinit="finish_previous",
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({name: float(value) for name, value in scalars.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


def build_loggers(
    metrics_cfg: MetricsConfig, output_dir: str | os.PathLike, rank: int, config_dict: Mapping[str, Any]
) -> list[ScalarLogger]:
    """The scalar loggers this rank should use: none except on rank 0 (see the module docstring).

    TensorBoard writes to ``output_dir/tb``; W&B to ``output_dir/wandb``.
    """
    if rank != 0:
        return []
    loggers: list[ScalarLogger] = []
    if metrics_cfg.tensorboard:
        loggers.append(TensorBoardLogger(Path(output_dir) / "tb", config=config_dict))
    if metrics_cfg.wandb:
        loggers.append(
            WandbLogger(metrics_cfg.wandb_project, metrics_cfg.wandb_mode, Path(output_dir), config_dict)
        )
    return loggers
