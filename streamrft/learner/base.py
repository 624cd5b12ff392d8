"""The Strategy interface (learner backend): FSDP2 now, DeepSpeed ZeRO behind the same methods."""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

import torch

# A loss function receives the model outputs for one microbatch and returns (loss, metrics).
LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Strategy(Protocol):
    module: torch.nn.Module  # the trainable (possibly sharded) model
    rank: int
    world_size: int
    device: torch.device

    def forward_backward(self, microbatch: dict[str, torch.Tensor], loss_fn: LossFn, temperature: float,
                         with_entropy: bool = False, stats_on_device: bool = False,
                         last_before_step: bool = True) -> dict[str, float]:
        """Accumulate gradients of one microbatch; its loss and metrics as floats, or with ``stats_on_device`` as
        detached device tensors the caller reads once per step (no host sync between microbatches).
        ``last_before_step=False``: more microbatches follow before ``step()`` (a strategy may then defer
        reducing the gradients; the call before ``step()`` must pass True)."""
        ...

    def step(self) -> dict[str, float]:
        """Clip, optimizer step, LR schedule, zero grads; returns grad_norm and lr."""
        ...

    def offload(self) -> None: ...

    def reload(self) -> None: ...

    def unshard_for_rollout(self) -> None:
        """Gather full parameters so the colocated engine can run forwards with no collectives."""
        ...

    def reshard_after_rollout(self) -> None: ...

    def full_state_for_engine(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...
