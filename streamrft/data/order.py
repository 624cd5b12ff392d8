"""A deterministic, resumable order over dataset rows: reshuffled each epoch from (seed, epoch)."""

from __future__ import annotations

import random


class EpochOrder:
    """Global prompt order shared by every rank. Position ``k`` maps to a row; the mapping depends only
    on (seed, n_rows, shuffle), so any rank can compute any position and resume is exact."""

    def __init__(self, n_rows: int, seed: int, shuffle: bool = True) -> None:
        if n_rows < 1:
            raise ValueError("EpochOrder needs at least one row")
        self.n_rows, self.seed, self.shuffle = n_rows, seed, shuffle
        self._cache: dict[int, list[int]] = {}

    def _epoch(self, epoch: int) -> list[int]:
        perm = self._cache.get(epoch)
        if perm is None:
            perm = list(range(self.n_rows))
            if self.shuffle:
                random.Random(f"{self.seed}-{epoch}").shuffle(perm)
            self._cache = {epoch: perm}  # keep one epoch; positions are consumed in order
        return perm

    def row_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.n_rows)
        return self._epoch(epoch)[offset]
