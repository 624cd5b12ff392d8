"""A trained RM as a reward: the ``type: model`` reward source and ``serve-reward --fn model:DIR``.

:class:`ModelReward` has the reward-function shape the scorer and the reward service use
(``name``, ``async score(items) -> list[float | Exception]``, ``async close()``). It loads an SRM
(reward = mean head output for prompt + response) or a GRM (see :mod:`streamrft.rm.judge`) from the
directory's ``rm.json`` and scores each call's items in batches of ``batch_size`` in a worker thread.

Media: an RM trained on media rows (rm.json ``media``) scores each item's prompt media + response: the item's
``media`` refs (``protocols.MediaRef``: path + sha256, filled by the RL runtime from the policy's own media
refs, or sent by a remote client to ``serve-reward``) are read from the shared filesystem, hash-checked and
decoded like the RL runtime does; pixels never travel in the message. An item whose media is missing, too
large (> ``max_media_bytes`` per file), changed or undecodable fails alone, with the reason. A text RM ignores
``media``.

Device: on a machine with CUDA the RM lives on the CPU between calls and is moved to the GPU only
for the duration of one ``score`` call, so it holds no GPU memory while the policy trains (one
host-device copy per call; on CPU it simply stays put). Calls are serialised by a lock.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Sequence

import torch

from protocols import RewardItem
from streamrft.rm.model import rm_kind


MAX_MEDIA_BYTES = 256 * 1024 * 1024  # one referenced file; a bigger one fails its item (bounded like the service)


class ModelReward:
    def __init__(self, model_dir: str, batch_size: int = 64, device: str | None = None,
                 max_media_bytes: int = MAX_MEDIA_BYTES) -> None:
        if not Path(model_dir).is_dir():  # a hub id of a trained RM in the local HF cache, else a clear error
            from streamrft.models.hub import resolve_model_dir

            model_dir = resolve_model_dir(model_dir, "reward model_path (a directory written by `streamrft train-rm`)")
        self.kind = rm_kind(model_dir)
        self.name = f"model:{model_dir}"
        self.batch_size = batch_size
        self.max_media_bytes = max_media_bytes
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

    @property
    def media(self) -> dict | None:
        return self.rm.media

    def check_media(self, item: RewardItem) -> None:
        """ValueError naming the item when a media RM cannot read its media (decoding errors come later,
        per item too)."""
        if not item.media:
            fields = ", ".join(f"{k}={v!r}" for k, v in self.media.items() if k.endswith("_field") and v)
            raise ValueError(f"sample {item.sample_id}: this reward model reads the prompt's media ({fields}) but the "
                             "item has no media refs; the policy's prompts need media "
                             "(data.image_field / video_field / audio_field)")
        for ref in item.media:
            try:
                size = os.stat(ref.path).st_size
            except OSError as exc:
                raise ValueError(f"sample {item.sample_id}: media file {ref.path!r} ({ref.kind}) cannot be read "
                                 f"({exc.strerror}); the scorer must share the filesystem of the run") from None
            if size > self.max_media_bytes:
                raise ValueError(f"sample {item.sample_id}: media file {ref.path!r} has {size} bytes, more than the "
                                 f"limit of {self.max_media_bytes}")

    def score_items_sync(self, items: Sequence[RewardItem]) -> list[float | Exception]:
        """One reward per item; an Exception in place of the reward of an item that could not be scored."""
        if not self.media:
            return self.score_sync([it.prompt for it in items], [it.response for it in items],
                                   [it.reference for it in items])
        out: list[float | Exception | None] = [None] * len(items)
        good = []
        for i, it in enumerate(items):
            try:
                self.check_media(it)
                good.append(i)
            except ValueError as exc:
                out[i] = exc

        def run(idx: list[int]) -> list[float | Exception]:
            return self.score_sync([items[i].prompt for i in idx], [items[i].response for i in idx],
                                   [items[i].reference for i in idx], [list(items[i].media) for i in idx])

        try:
            for i, r in zip(good, run(good) if good else []):
                out[i] = r
        except ValueError:  # a file that does not decode (MediaError) or changed: find it, score the rest
            for i in good:
                try:
                    out[i] = run([i])[0]
                except ValueError as exc:
                    out[i] = ValueError(f"sample {items[i].sample_id}: {exc}")
        return out  # type: ignore[return-value]

    def score_sync(self, prompts: list[str], responses: list[str], references: list[str],
                   media: list[list] | None = None) -> list[float | Exception]:
        with self._lock:
            offload = self.device.type != "cpu"
            if offload:
                self.module.to(self.device)
            try:
                if self.kind == "srm":
                    return list(self.rm.score(prompts, responses, self.batch_size, media))
                return self.rm.rewards(prompts, responses, references, media)
            finally:
                if offload:
                    self.module.to("cpu")

    async def score(self, items: Sequence[RewardItem]) -> list[float | Exception]:
        if not items:
            return []
        return await asyncio.to_thread(self.score_items_sync, list(items))

    async def close(self) -> None:
        return None
