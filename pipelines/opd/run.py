"""On-policy distillation demo: prepare, start the teacher service, train the student, report.

    python pipelines/opd/run.py [key=value ...]

The last line: ``opd: student_heldout_accuracy_before=... after=... teacher=... steps=N seconds=S``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipelines.opd.prepare import prepare  # noqa: E402
from streamrft.config import load_config  # noqa: E402
from streamrft.compose import train  # noqa: E402


def start_teacher(model_dir: str, address: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrft.cli", "serve-teacher", "--model", model_dir, "--bind", address],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if "serve-teacher: ready" in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the teacher service at {address} did not start; its output ends: {line!r}")


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    cfg = load_config(ROOT / "pipelines" / "opd" / "config.yaml", argv)
    paths = prepare(str(Path(cfg.data.train_path).parent))
    teacher = start_teacher(paths["teacher"], cfg.teacher.address)
    try:
        summary = train(cfg)
    finally:
        teacher.terminate()
        teacher.wait(30)
    print(
        f"opd: student_heldout_accuracy_before={summary['heldout_accuracy_before']:.3f} "
        f"after={summary['heldout_accuracy_after']:.3f} teacher={paths['teacher_accuracy']:.3f} "
        f"steps={summary['steps']} seconds={time.perf_counter() - started:.0f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
