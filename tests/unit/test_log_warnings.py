"""What the async placement's engine processes should tell the user reaches the learner's console: a child's
log file's warnings, echoed once each (runtime/log_warnings.py: a real second process writing Python warnings
into its log, lines completed across reads, a truncated log), and the warning for engines sharing the
learner's GPU without a memory cap."""

from __future__ import annotations

import io
import subprocess
import sys

from streamrft.runtime.log_warnings import LogWarnings

CHILD = """
import sys, warnings
print("Loading weights: 100%", flush=True)
warnings.warn("hf engine on cuda:0: a chunk of 512 rows needs 31.2 GiB; chunks take 330 rows at a time")
print("streamrft: not a warning", flush=True)
warnings.warn("the Triton kernels failed", RuntimeWarning)
"""


def test_a_child_process_warnings_are_echoed_once_each_naming_the_label(tmp_path):
    path = tmp_path / "engine0.log"
    out = io.StringIO()
    watch = LogWarnings(path, "engine rank 0", out)
    assert watch.echo_new() == []  # no log yet
    with open(path, "w") as log:
        subprocess.run([sys.executable, "-c", CHILD], stdout=log, stderr=subprocess.STDOUT, check=True, timeout=60)
    found = watch.echo_new()
    assert found == ["UserWarning: hf engine on cuda:0: a chunk of 512 rows needs 31.2 GiB; chunks take 330 rows at a time",
                     "RuntimeWarning: the Triton kernels failed"]
    assert out.getvalue().splitlines() == [f"streamrft: engine rank 0: {w}" for w in found]
    assert watch.echo_new() == []  # each once


def test_a_line_still_being_written_waits_for_its_end_and_a_truncated_log_is_read_again(tmp_path):
    path = tmp_path / "engine1.log"
    watch = LogWarnings(path, "engine rank 1", io.StringIO())
    path.write_bytes(b"x.py:3: UserWarning: first\nx.py:4: UserWarn")
    assert watch.echo_new() == ["UserWarning: first"]
    with open(path, "ab") as f:
        f.write(b"ing: second\n")
    assert watch.echo_new() == ["UserWarning: second"]
    path.write_bytes(b"y.py:1: FutureWarning: after a restart\n")  # shorter than what was read: a new log
    assert watch.echo_new() == ["FutureWarning: after a restart"]


def test_engines_sharing_the_learner_gpu_without_a_memory_cap_are_warned_about():
    from streamrft.runtime.async_placement import uncapped_share_warning

    assert uncapped_share_warning("cpu", 0.0) is None  # CPU engines: no device memory to share
    assert uncapped_share_warning("cuda:0", 0.3) is None  # capped
    message = uncapped_share_warning("cuda:1", 0.0)
    assert message.startswith("rollout.placement=async: the engine processes share cuda:1 with the learner and "
                              "rollout.engine_memory_fraction=0 caps neither")
