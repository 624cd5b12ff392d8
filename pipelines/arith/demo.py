"""`make demo`: build the tiny model and data, warm it up, run GRPO, report held-out accuracy.

    python pipelines/arith/demo.py [CONFIG] [key=value ...]

The last line is machine-readable:
    demo: heldout_accuracy_before=0.xx heldout_accuracy_after=0.yy steps=N seconds=S

The demo starts fresh every time: it removes its RL output_dir (runs/arith/rl) before training, so a
second `make demo` trains again instead of resuming the finished run; the prepared model and data
(runs/arith/sft, *.jsonl) are reused. A plain `streamrft train` never deletes a run (checkpoint.resume).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from prepare import prepare_from_config  # noqa: E402  (pipelines are scripts, not a package)

from streamrft.config import load_config  # noqa: E402
from streamrft.compose import train  # noqa: E402


def clear_output_dir(cfg) -> None:
    """Remove the demo's previous RL run; refuse when output_dir holds the prepared model or data."""
    out = Path(cfg.output_dir).resolve()
    if not out.exists():
        return
    for key, value in (("model.path", cfg.model.path), ("data.train_path", cfg.data.train_path),
                       ("data.eval_path", cfg.data.eval_path)):
        if value and (Path(value).resolve() == out or out in Path(value).resolve().parents):
            raise SystemExit(f"demo: output_dir={cfg.output_dir} holds {key}={value}; the demo removes its "
                             "output_dir before training, so point output_dir at a folder of its own")
    shutil.rmtree(out)
    print(f"demo: removed the previous run in {cfg.output_dir} (the demo starts fresh; the prepared model "
          f"{cfg.model.path} is reused)", flush=True)


def main(argv: list[str]) -> int:
    config = argv[0] if argv and not "=" in argv[0] else str(HERE / "config.yaml")
    overrides = argv[1:] if argv and not "=" in argv[0] else argv
    started = time.perf_counter()
    prepare_from_config(config, overrides)
    cfg = load_config(config, overrides)
    clear_output_dir(cfg)
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
