"""`make demo`: build the tiny model and data, warm it up, run GRPO, report held-out accuracy.

    python pipelines/arith/demo.py [CONFIG] [key=value ...]

The last line is machine-readable:
    demo: heldout_accuracy_before=0.xx heldout_accuracy_after=0.yy steps=N seconds=S
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from prepare import prepare_from_config  # noqa: E402  (pipelines are scripts, not a package)

from streamrft.config import load_config  # noqa: E402
from streamrft.compose import train  # noqa: E402


def main(argv: list[str]) -> int:
    config = argv[0] if argv and not "=" in argv[0] else str(HERE / "config.yaml")
    overrides = argv[1:] if argv and not "=" in argv[0] else argv
    started = time.perf_counter()
    prepare_from_config(config, overrides)
    cfg = load_config(config, overrides)
    summary = train(cfg)
    seconds = time.perf_counter() - started
    print(
        f"demo: heldout_accuracy_before={summary['heldout_accuracy_before']:.2f} "
        f"heldout_accuracy_after={summary['heldout_accuracy_after']:.2f} "
        f"steps={summary['steps']} seconds={seconds:.0f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
