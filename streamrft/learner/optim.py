"""AdamW and the learning-rate schedules named by train.lr_schedule.

With s = the number of optimizer steps already taken (0 for the first step), W = train.warmup_steps,
S = total_steps, r = train.min_lr_ratio, the LR used by step s is lr * f(s):

  warm-up (s < W):      f(s) = (s + 1) / W                       (both schedules)
  "constant" (s >= W):  f(s) = 1
  "cosine"   (s >= W):  f(s) = r + (1 - r) * 0.5 * (1 + cos(pi * min(1, (s - W) / max(1, S - W))))

so cosine starts at lr right after warm-up and reaches r * lr at s = S.

``ShardLocalAdamW`` is torch's AdamW with its update run on each DTensor's local shard (its docstring says
why); its state, state dict and numbers are torch AdamW's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable

import torch

if TYPE_CHECKING:
    from streamrft.config.train import TrainConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], train_cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW (ShardLocalAdamW) over the trainable ``params`` with lr, betas, eps and weight_decay from ``train_cfg``."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters; check model.freeze_prefix, it may freeze the whole model")
    if len(train_cfg.adam_betas) != 2:
        raise ValueError(f"train.adam_betas={train_cfg.adam_betas} must have two values, e.g. [0.9, 0.999]")
    if train_cfg.lr <= 0:
        raise ValueError(f"train.lr={train_cfg.lr} must be > 0")
    beta1, beta2 = train_cfg.adam_betas
    if train_cfg.optimizer_offload:  # the moments in host memory (learner/host_adamw.py)
        from streamrft.learner.host_adamw import HostAdamW

        return HostAdamW(params, lr=train_cfg.lr, betas=(beta1, beta2), eps=train_cfg.adam_eps,
                         weight_decay=train_cfg.weight_decay)
    return ShardLocalAdamW(params, lr=train_cfg.lr, betas=(beta1, beta2), eps=train_cfg.adam_eps,
                           weight_decay=train_cfg.weight_decay, fused=train_cfg.fused_adamw or None)


class ShardLocalAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose update runs on the local shards of DTensor parameters (FSDP2's).

    AdamW is elementwise: each rank's shard of a parameter is updated from the same shard of its gradient
    and moments, so the update needs no DTensor dispatch. Through DTensor, every foreach op of the step
    went through sharding propagation over ~300 tensors, and when that cache missed (on some steps, not
    others) the step took 0.9-1.0 s of host time instead of 0.02 s at 0.5B on the H200 (benchmarks/NOTES.md
    v15). Here torch's own ``_init_group`` gathers the group's tensors and creates missing state exactly as
    AdamW.step does (the moments stay DTensors: the state dict and checkpoints are unchanged), and torch's
    functional ``adam`` runs on their local tensors, which share storage with the DTensors."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardLocalAdamW.step takes no closure (the learner computes the loss itself)")
        from torch.optim.adam import adam

        from streamrft.learner.host_adamw import local_shard

        for group in self.param_groups:
            lists: tuple[list, ...] = ([], [], [], [], [], [])  # params, grads, exp_avgs, exp_avg_sqs, max, steps
            has_complex = self._init_group(group, *lists)
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = ([local_shard(t) for t in ts] for ts in lists)
            beta1, beta2 = group["betas"]
            adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
                 has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"],
                 capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
                 grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                 decoupled_weight_decay=True)
        return None


def lr_factor(schedule: str, step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """f(s) from the module docstring."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.lr_schedule={schedule!r} is unknown; use one of {sorted(SCHEDULES)}")


SCHEDULES = ("constant", "cosine")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following train.lr_schedule; call ``scheduler.step()`` after each ``optimizer.step()``."""
    if train_cfg.lr_schedule not in SCHEDULES:
        raise ValueError(f"train.lr_schedule={train_cfg.lr_schedule!r} is unknown; use one of {list(SCHEDULES)}")
    if train_cfg.warmup_steps < 0:
        raise ValueError(f"train.warmup_steps={train_cfg.warmup_steps} must be >= 0")
    if not 0.0 <= train_cfg.min_lr_ratio <= 1.0:
        raise ValueError(f"train.min_lr_ratio={train_cfg.min_lr_ratio} must be in [0, 1]")
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps} must be > 0; check train.max_steps")
    fn: Callable[[int], float] = lambda s: lr_factor(  # noqa: E731
        train_cfg.lr_schedule, s, train_cfg.warmup_steps, total_steps, train_cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
