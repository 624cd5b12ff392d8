from __future__ import annotations

from streamrft.config.base import Section


class CheckpointConfig(Section):
    save_every: int = 0  # save every N steps; 0 = only on SIGTERM / end
    keep: int = 2  # checkpoints kept (rotation)
    resume: bool = True  # resume from the latest checkpoint in output_dir if present
