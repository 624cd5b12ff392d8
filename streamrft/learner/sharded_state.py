"""A sharded model's checkpoint state (model, optimizer and LR scheduler) under torch.distributed.checkpoint.

One place for the FSDP2 policy (fsdp2.py) and the critic (critic.py): what ``save`` writes, and a ``load``
that reads it back without unpickling code from the checkpoint folder (checkpoint/safe_load.py). The
critic used stock ``dcp.load``, so a hostile critic checkpoint under ``output_dir`` could run code on
resume while the policy's could not.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from streamrft.checkpoint.safe_load import safe_load_kwargs


def sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """What ``save`` writes: views of the live state (checkpoint/staging.py copies it for async saves)."""
    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}


def load_sharded_state(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                       what: str, rank: int) -> None:
    """Restore what ``dcp.save(sharded_state(...))`` wrote (all ranks call; DCP reshards to this world size).
    ``what`` names the checkpoint in the error for a missing folder."""
    if not os.path.isdir(path):
        raise ValueError(f"{what} {path!r} (rank {rank}) does not exist; check checkpoint.resume")
    state = sharded_state(module, optimizer, scheduler)
    dcp.load(state, **safe_load_kwargs(path))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
