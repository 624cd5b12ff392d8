"""The critic (value model) for GAE: the policy backbone with a scalar head, sharded with FSDP2.

The value of the state before response token t (the prefix x_<t) is read, like log-probs, from the
hidden state at position t - 1:

    values[b, t] = w · h[b, t-1] + c   at response positions (0 elsewhere, and at sequence starts),

so ``values_BL`` is aligned with ``logp_BL`` and the response mask, as GAE (``algorithms.gae``) expects.
It trains on the PPO clipped value loss (``algorithms.value_loss``, Schulman et al., 2017):

    L = sum_t 0.5 max((V_t - R_t)^2, (V_old + clip(V_t - V_old, -eps, eps) - R_t)^2) / n_tokens_global,

with eps = algorithm.value_clip_eps, summed over microbatches and ranks (the gradient convention of
fsdp2.py: FSDP's divide factor is 1, so rank gradients are summed). Its optimizer is AdamW at
train.critic_lr with the other train.* AdamW settings and the same LR schedule.

The backbone is ``AutoModel.from_pretrained(model.critic_path)`` (a causal-LM directory loads without
its LM head); the head is Linear(H, 1) with weight ~ N(0, 1/H) from a fixed seed and bias 0.
Packed microbatches (``packing.py``) work as for the policy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from streamrft.algorithms import value_loss
from streamrft.learner.fsdp2 import move_batch
from streamrft.learner.logprobs import text_mask_and_positions
from streamrft.learner.optim import build_lr_scheduler, build_optimizer
from streamrft.learner.sharded_state import load_sharded_state, sharded_state

if TYPE_CHECKING:
    from streamrft.config.model import ModelConfig
    from streamrft.config.train import TrainConfig
    from streamrft.runtime.distributed import DistInfo

HEAD_SEED = 0  # the value head's init seed (the same head on every rank)


class ValueModel(torch.nn.Module):
    """backbone (a HF base model) + Linear(H, 1); forward(mb) -> values_BL (see the module docstring)."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        H = backbone.config.hidden_size
        self.head = torch.nn.Linear(H, 1)
        g = torch.Generator().manual_seed(HEAD_SEED)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, H, generator=g) / math.sqrt(H))
            self.head.bias.zero_()

    def forward(self, input_ids, attention_mask, position_ids, response_mask) -> torch.Tensor:
        hidden_BLH = self.backbone(input_ids=input_ids, use_cache=False,
                                   **text_mask_and_positions(self.backbone, attention_mask, position_ids)).last_hidden_state
        v_BL = self.head(hidden_BLH).squeeze(-1).float()
        shifted_BL = torch.cat([torch.zeros_like(v_BL[:, :1]), v_BL[:, :-1]], dim=1)  # V at t from h[t-1]
        keep_BL = response_mask.bool() & (position_ids != 0)
        keep_BL[:, 0] = False
        return shifted_BL * keep_BL


def load_value_model(path: str) -> ValueModel:
    from transformers import AutoModel

    from streamrft.models.hub import resolve_model_dir

    path = resolve_model_dir(path, "model.critic_path")  # a directory or a cached hub id
    return ValueModel(AutoModel.from_pretrained(path, dtype=torch.float32))


class Critic:
    """The value model on this rank, FSDP2-sharded, with its own AdamW (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, value_clip_eps: float,
                 dist: DistInfo, total_steps: int):
        if train_cfg.critic_lr <= 0:
            raise ValueError(f"train.critic_lr={train_cfg.critic_lr} must be > 0")
        self.rank, self.world_size, self.device = dist.rank, dist.world_size, dist.device
        self.value_clip_eps, self.train_cfg = value_clip_eps, train_cfg
        model = load_value_model(model_cfg.critic_path)
        model.backbone.config.use_cache = False
        model.train()
        mesh = init_device_mesh(dist.device.type, (dist.world_size,))
        for layer in model.backbone.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.module = model.to(self.device)
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum over ranks
                m.set_force_sum_reduction_for_comms(True)
        critic_train = msgspec.structs.replace(train_cfg, lr=train_cfg.critic_lr)
        self.optimizer = build_optimizer(self.module.parameters(), critic_train)
        self.scheduler = build_lr_scheduler(self.optimizer, critic_train, total_steps)

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        mb = move_batch(mb, self.device)
        return self.module(mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["response_mask"])

    @torch.no_grad()
    def values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """values_BL (float32, 0 outside response positions) under the current weights."""
        return self._values(mb)

    def forward_backward(self, mb: dict[str, torch.Tensor], returns_BL: torch.Tensor, old_values_BL: torch.Tensor,
                         n_tokens_global: float) -> dict[str, float]:
        """Accumulate the gradient of the clipped value loss of one microbatch, normalised by the global
        response-token count; returns {"value_loss": ..., "vf_clipped_sum": ...} (this microbatch)."""
        if n_tokens_global <= 0:
            raise ValueError(f"n_tokens_global={n_tokens_global} must be > 0")
        values_BL = self._values(mb)
        mask_BL = mb["response_mask"].to(self.device, torch.float32)
        loss_BL, metrics = value_loss(values_BL, old_values_BL.to(self.device), returns_BL.to(self.device),
                                      mask_BL, self.value_clip_eps)
        loss = loss_BL.sum() / n_tokens_global
        loss.backward()
        return {"value_loss": float(loss.detach()), "vf_clipped_sum": float(metrics["vf_clipped"].sum())}

    def step(self) -> dict[str, float]:
        """Clip to train.grad_clip, AdamW step, schedule step, zero grads -> critic_grad_norm, critic_lr."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if self.train_cfg.grad_clip > 0 and params:
            torch.nn.utils.clip_grads_with_norm_(params, self.train_cfg.grad_clip, norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(float(norm)):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"critic_grad_norm": float(norm), "critic_lr": lr}

    def train_step(self, mbs: list[dict[str, torch.Tensor]], n_tokens_global: float) -> dict[str, float]:
        """forward_backward over ``mbs`` (each holding "returns" and "old_values", (B, L)), then step."""
        totals = {"value_loss": 0.0, "vf_clipped_sum": 0.0}
        for mb in mbs:
            out = self.forward_backward(mb, mb["returns"], mb["old_values"], n_tokens_global)
            for k, v in out.items():
                totals[k] += v
        return {**totals, **self.step()}

    # ---- memory and checkpoints (as FSDP2Strategy) -----------------------------------------------------
    def offload(self) -> None:
        """Params and optimizer state to CPU (a no-op when training on CPU)."""
        self._move_to(torch.device("cpu"))

    def reload(self) -> None:
        self._move_to(self.device)

    def _move_to(self, device: torch.device) -> None:
        from streamrft.learner.memory import move_module_and_optimizer

        move_module_and_optimizer(self.module, self.optimizer, device, self.device)

    def state_for_save(self) -> dict:
        """What ``save`` writes (views of the live state; checkpoint/staging.py copies it for async saves)."""
        return sharded_state(self.module, self.optimizer, self.scheduler)

    def save(self, path: str) -> None:
        dcp.save(self.state_for_save(), checkpoint_id=path)

    def load(self, path: str) -> None:
        load_sharded_state(path, self.module, self.optimizer, self.scheduler, "critic checkpoint", self.rank)
