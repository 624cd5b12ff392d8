"""checkpoint.async_save=true through the CLI: a background write that fails (a file-size limit on the
shards) ends the run with exit 1 and the error, not exit 0 with the checkpoint missing. (Exact resume
with async saves on two ranks: tests/integration/test_resume.py.)"""

from __future__ import annotations

import resource
import subprocess

import pytest

from streamrft.checkpoint import complete_checkpoints, step_dir
from tests.integration.conftest import REPO
from tests.integration.test_resume import command

pytestmark = pytest.mark.slow


def test_a_failing_background_write_ends_the_run_with_its_error(arith_dir, tmp_path):
    cmd, env = command(arith_dir, tmp_path, 1, "checkpoint.async_save=true", "train.max_steps=1")

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (60000, resource.RLIM_INFINITY))  # the model shard is larger

    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240, preexec_fn=limit)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"streamrft: error: saving checkpoint {step_dir(tmp_path, 1)} failed: EFBIG, file too "
                           "large (a file-size limit, e.g. `ulimit -f`) (the save raised CheckpointException: "), last
    assert "step 1/1" in proc.stdout  # the step itself completed: the failure came from the background write
    assert complete_checkpoints(tmp_path) == []
