"""Without a GPU, the Triton decode kernels' tests (test_triton_decode.py) run under Triton's interpreter,
in a subprocess: TRITON_INTERPRET must be set before triton's first import, and only there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU test_triton_decode.py runs directly"),
              pytest.mark.timeout(600)]


ROOT = Path(__file__).resolve().parents[2]
# `make setup` installs triton (and a numpy its interpreter accepts) here, outside the venv (see the Makefile)
TRITON_SITE = Path(os.environ.get("STREAMRFT_TRITON_SITE", ROOT / ".venv" / "triton-site"))


def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if (TRITON_SITE / "triton").is_dir():
        env["PYTHONPATH"] = os.pathsep.join([str(TRITON_SITE), str(ROOT), env.get("PYTHONPATH", "")])
    else:
        pytest.importorskip("triton", reason=f"no triton in the venv nor in {TRITON_SITE} (make setup puts it there)")
    target = Path(__file__).with_name("test_triton_decode.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target)],
                          env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
