"""A trained RM as a reward: the ``type: model`` reward source and ``serve-reward --fn model:DIR``.

:class:`ModelReward` has the reward-function shape the scorer and the reward service use
(``name``, ``async score(items) -> list[float | Exception]``, ``async close()``). It loads an SRM
(reward = mean head output for prompt + response) or a GRM (see :mod:`streamrft.rm.judge`) from the
directory's ``rm.json`` and scores each call's items in batches of ``batch_size`` in a worker thread.

Device: on a machine with CUDA the RM lives on the CPU between calls and is moved to the GPU only
for the duration of one ``score`` call, so it holds no GPU memory while the policy trains (one
host-device copy per call; on CPU it simply stays put). Calls are serialised by a lock.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Sequence

import torch

from protocols import RewardItem
from streamrft.rm.model import rm_kind


class ModelReward:
    def __init__(self, model_dir: str, batch_size: int = 64, device: str | None = None) -> None:
        if not Path(model_dir).is_dir():  # a hub id of a trained RM in the local HF cache, else a clear error
            from streamrft.models.hub import resolve_model_dir

            model_dir = resolve_model_dir(model_dir, "reward model_path (a directory written by `streamrft train-rm`)")
        self.kind = rm_kind(model_dir)
        self.name = f"model:{model_dir}"
        self.batch_size = batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.kind == "srm":
            from streamrft.rm.model import ScalarRewardModel

            self.rm = ScalarRewardModel.from_pretrained(model_dir)
            self.module = self.rm
        else:
            from streamrft.rm.judge import GenerativeJudge

            self.rm = GenerativeJudge.from_pretrained(model_dir)
            self.module = self.rm.model
        self._lock = threading.Lock()

    def score_sync(self, prompts: list[str], responses: list[str], references: list[str]) -> list[float | Exception]:
        with self._lock:
            offload = self.device.type != "cpu"
            if offload:
                self.module.to(self.device)
            try:
                if self.kind == "srm":
                    return list(self.rm.score(prompts, responses, self.batch_size))
                return self.rm.rewards(prompts, responses, references)
            finally:
                if offload:
                    self.module.to("cpu")

    async def score(self, items: Sequence[RewardItem]) -> list[float | Exception]:
        if not items:
            return []
        return await asyncio.to_thread(self.score_sync, [it.prompt for it in items],
                                       [it.response for it in items], [it.reference for it in items])

    async def close(self) -> None:
        return None
