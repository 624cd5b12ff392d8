"""A frozen reference model (for KL penalties): loaded once, sharded like the policy, never trained."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamrft.learner.fsdp2 import _DTYPES, LOGPROB_METHOD, load_pretrained, move_batch, shard_model

if TYPE_CHECKING:
    from streamrft.config.model import ModelConfig
    from streamrft.runtime.distributed import DistInfo


class FrozenReference:
    """``FrozenReference(model_path, model_cfg, dist).compute_logprobs(mb, temperature) -> logp_BL``.

    Weights are held in model.dtype (no float32 master copy), requires_grad=False, eval mode, and
    sharded with FSDP2 (each decoder layer, then the root) with resharding after every forward.
    """

    def __init__(self, model_path: str, model_cfg: ModelConfig, dist: DistInfo):
        path = model_path or model_cfg.reference_path or model_cfg.path
        self.rank, self.device = dist.rank, dist.device
        model = load_pretrained(path, model_cfg, _DTYPES[model_cfg.dtype])
        model.requires_grad_(False)
        model.eval()
        model.config.use_cache = False
        self.module = shard_model(model, dist, compute_dtype=None).to(self.device)

    @torch.no_grad()
    def compute_logprobs(self, mb: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """logp_BL (float32) of mb's tokens under the reference model; 0 outside the response mask."""
        logp_BL, _ = getattr(self.module, LOGPROB_METHOD)(move_batch(mb, self.device), temperature, False)
        return logp_BL
