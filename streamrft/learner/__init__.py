"""Learner strategies, chosen by train.strategy through the explicit STRATEGIES dict."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrft.config.model import ModelConfig
    from streamrft.config.train import TrainConfig
    from streamrft.runtime.distributed import DistInfo



def _fsdp2_strategy(model_cfg, train_cfg, dist, total_steps):
    """FSDP2Strategy, imported on use: importing this package stays light (torch is not imported), so the compile
    warm-up's child (learner/compile_warmup.py) can start before the run's imports."""
    from streamrft.learner.fsdp2 import FSDP2Strategy

    return FSDP2Strategy(model_cfg, train_cfg, dist, total_steps)


def _deepspeed_strategy(model_cfg, train_cfg, dist, total_steps):
    """DeepSpeedStrategy, imported on use: deepspeed is an optional dependency."""
    from streamrft.learner.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(model_cfg, train_cfg, dist, total_steps)


STRATEGIES = {"fsdp2": _fsdp2_strategy, "deepspeed": _deepspeed_strategy}  # name -> constructor


def build_strategy(model_cfg: ModelConfig, train_cfg: TrainConfig, dist: DistInfo, total_steps: int):
    """The strategy named by train.strategy, built for this rank."""
    cls = STRATEGIES.get(train_cfg.strategy)
    if cls is None:
        raise ValueError(f"train.strategy={train_cfg.strategy!r} is not available; "
                         f"use one of {sorted(STRATEGIES)}")
    return cls(model_cfg, train_cfg, dist, total_steps)
